"""A small ViT-style vision encoder: patch embedding + pre-norm transformer, projected to the LM width.

Stored in `<model_dir>/vision_encoder/` (config.json + model.safetensors), a subfolder so the LM
loader, which reads every *.safetensors in the model directory, never sees its tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load_file, save_file
from torch import nn

from engine.encoder.prompt import VISION_SUBDIR
from engine.runtime.errors import CheckpointError



class VisionConfig(BaseModel):
    """Shape of the vision encoder; `num_patches` is the prompt length one image occupies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image_size: int = Field(64, gt=0, description="images are resized to image_size x image_size")
    patch_size: int = Field(16, gt=0, description="square patch side in pixels")
    width: int = Field(128, gt=0, description="transformer width")
    num_layers: int = Field(2, gt=0, description="transformer blocks")
    num_heads: int = Field(4, gt=0, description="attention heads")
    out_size: int = Field(gt=0, description="LM hidden size the patches are projected to")
    norm_eps: float = Field(1e-6, gt=0, description="LayerNorm epsilon")

    @model_validator(mode="after")
    def _check(self) -> "VisionConfig":
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        if self.width % self.num_heads:
            raise ValueError(f"width ({self.width}) must be a multiple of num_heads ({self.num_heads})")
        return self

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class _Block(nn.Module):
    def __init__(self, c: VisionConfig) -> None:
        super().__init__()
        self.heads = c.num_heads
        self.norm1 = nn.LayerNorm(c.width, eps=c.norm_eps)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.norm2 = nn.LayerNorm(c.width, eps=c.norm_eps)
        self.fc1 = nn.Linear(c.width, 4 * c.width)
        self.fc2 = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionEncoder(nn.Module):
    """pixels [B, 3, S, S] (normalised) -> patch embeddings [B, num_patches, out_size]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch = nn.Conv2d(3, config.width, config.patch_size, stride=config.patch_size)
        self.pos = nn.Parameter(torch.zeros(config.num_patches, config.width))
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.width, eps=config.norm_eps)
        self.out = nn.Linear(config.width, config.out_size)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def write_vision_encoder(model_dir: str | Path, hidden_size: int, seed: int = 0, **overrides) -> Path:
    """Seeded random weights (N(0, 0.02), unit norms) for an encoder projecting to `hidden_size`."""
    config = VisionConfig(out_size=hidden_size, **overrides)
    torch.manual_seed(seed)
    model = VisionEncoder(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in model.state_dict().items():
        if "norm" in name:
            state[name] = torch.ones_like(value) if name.endswith("weight") else torch.zeros_like(value)
        else:
            state[name] = torch.randn(value.shape, generator=gen) * 0.02
    out = Path(model_dir) / VISION_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.model_dump_json(indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_vision_encoder(model_dir: str | Path, device: str | torch.device = "cpu") -> VisionEncoder:
    """The encoder saved next to the LM checkpoint in `model_dir`; errors say what to run when it is absent."""
    path = Path(model_dir) / VISION_SUBDIR
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{model_dir} has no {VISION_SUBDIR}/ (config.json + model.safetensors): "
                              "write one with engine.encoder.vision.write_vision_encoder")
    try:
        config = VisionConfig(**json.loads((path / "config.json").read_text()))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise CheckpointError(f"{path / 'config.json'} is not a valid vision encoder config: {exc}") from None
    model = VisionEncoder(config)
    try:
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path / 'model.safetensors'} does not match its config.json: {exc}") from None
    return model.to(device).eval()
