"""Model architecture config: one pydantic model, read from and written to HF `config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.runtime.errors import CheckpointError

if TYPE_CHECKING:  # torch loads only where a model is built: a router reads configs without it
    import torch

Architecture = Literal["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
SUPPORTED_ARCHITECTURES: tuple[str, ...] = Architecture.__args__  # type: ignore[attr-defined]
MAX_CONTEXT = 32768


class ModelConfig(BaseModel):
    """Architecture of a Mixtral/Qwen-MoE style decoder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Architecture = Field("MixtralForCausalLM", description="HF architecture name")
    vocab_size: int = Field(gt=0, description="tokens in the vocabulary")
    hidden_size: int = Field(gt=0, description="model width")
    num_layers: int = Field(gt=0, description="decoder layers")
    num_heads: int = Field(gt=0, description="query heads")
    num_kv_heads: int = Field(gt=0, description="key/value heads (grouped-query attention)")
    head_dim: int = Field(gt=0, description="width of one attention head")
    num_experts: int = Field(gt=0, description="routed experts per MoE layer")
    experts_per_token: int = Field(gt=0, description="experts chosen per token (top-k)")
    num_shared_experts: int = Field(0, ge=0, le=1, description="always-on shared experts (Qwen2-MoE: 1)")
    intermediate_size: int = Field(gt=0, description="FFN width of dense layers")
    moe_intermediate_size: int = Field(gt=0, description="FFN width of one routed expert")
    shared_expert_intermediate_size: int = Field(0, ge=0, description="FFN width of the shared expert")
    dense_layers: tuple[int, ...] = Field((), description="layer indices with a dense MLP instead of MoE")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k router weights to sum to 1")
    attention_bias: bool = Field(False, description="q/k/v projections carry a bias (Qwen2-MoE)")
    qk_norm: bool = Field(False, description="per-head RMSNorm on q and k (Qwen3-MoE)")
    rope_theta: float = Field(1e6, gt=0, description="rotary base")
    rms_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon")
    max_position_embeddings: int = Field(4096, gt=0, description="longest context")
    tie_word_embeddings: bool = Field(False, description="lm_head shares the embedding matrix")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weight and activation dtype")
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.num_shared_experts and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_intermediate_size is required with a shared expert")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    @property
    def context_length(self) -> int:
        """Longest sequence served; capped so the rotary table stays small on huge-context configs."""
        return min(self.max_position_embeddings, MAX_CONTEXT)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def param_count(self, active: bool = False) -> int:
        """Parameters in total, or those touched per token when `active`."""
        h = self.hidden_size
        attn = h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        experts = self.experts_per_token if active else self.num_experts
        moe = 3 * h * self.moe_intermediate_size * experts + h * self.num_experts
        moe += 3 * h * self.shared_expert_intermediate_size * self.num_shared_experts
        dense = 3 * h * self.intermediate_size
        layers = sum(attn + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + (embed // 2 if active and not self.tie_word_embeddings else embed)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
        """Map a Hugging Face `config.json` dict; unknown architectures fail naming the field."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"config.json field 'architectures' is {archs!r}; tideflow supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            return cls(**_hf_fields(arch, hf, dtype))
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required field {exc.args[0]!r} for {arch}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"]) or "config"
            raise CheckpointError(f"config.json is invalid for {arch}: {loc}: {first['msg']}") from None

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` that transformers reads for this architecture."""
        common = {
            "architectures": [self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts_per_tok": self.experts_per_token,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.architecture == "MixtralForCausalLM":
            return common | {"model_type": "mixtral", "num_local_experts": self.num_experts,
                             "intermediate_size": self.moe_intermediate_size}
        return common | {
            "model_type": "qwen2_moe" if self.architecture == "Qwen2MoeForCausalLM" else "qwen3_moe",
            "num_experts": self.num_experts,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "mlp_only_layers": list(self.dense_layers),
            "decoder_sparse_step": 1,
            "qkv_bias": self.attention_bias,
            "attention_bias": self.attention_bias,
        }


def _hf_fields(arch: str, hf: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    fields: dict[str, Any] = {
        "architecture": arch,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "experts_per_token": hf["num_experts_per_tok"],
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 1e6 if arch == "MixtralForCausalLM" else 1e4)),
        "rms_eps": hf.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "dtype": dtype or _hf_dtype(hf),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_id": hf.get("eos_token_id"),
    }
    if arch == "MixtralForCausalLM":
        return fields | {"num_experts": hf["num_local_experts"], "intermediate_size": hf["intermediate_size"],
                         "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True}
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(hf["num_hidden_layers"]) if i in mlp_only or (i + 1) % step)
    shared = hf.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
    return fields | {
        "num_experts": hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
        "intermediate_size": hf["intermediate_size"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "num_shared_experts": 1 if shared else 0,
        "shared_expert_intermediate_size": shared,
        "dense_layers": dense,
        "norm_topk_prob": hf.get("norm_topk_prob", False),
        "attention_bias": hf.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM" else hf.get("attention_bias", False),
        "qk_norm": arch == "Qwen3MoeForCausalLM",
    }


def _hf_dtype(hf: dict[str, Any]) -> str:
    raw = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return "bfloat16" if raw == "bfloat16" else "float32"


def read_config(model_dir: str | Path, dtype: str | None = None) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json: point --model at a Hugging Face checkpoint directory")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    return ModelConfig.from_hf(hf, dtype)
