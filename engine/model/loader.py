"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into MoEForCausalLM."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError, safe_open

from engine.model.config import ModelConfig, read_config
from engine.runtime.errors import CheckpointError
from engine.model.decoder import MoEForCausalLM
from engine.model.moe import Experts, SparseMoE
from engine.model.packed_linear import pack_linears
from engine.model.weight_arena import move_weights

log = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path, dtype: str | None = None, device: str | torch.device = "cpu",
    expert_ids: Sequence[Sequence[int]] | None = None,
) -> MoEForCausalLM:
    """Build the model from config.json and fill every parameter from the safetensors files.

    `expert_ids[layer]` lists the logical experts (repeats allowed, for replicas) a rank holds in
    that layer's local slots, in slot order; None loads every expert. Missing tensors, wrong shapes
    and unreadable files fail with a CheckpointError naming them.
    """
    config = read_config(model_dir, dtype)
    with torch.device("meta"):
        model = MoEForCausalLM(config)
        if expert_ids is not None:
            _shard_experts(model, expert_ids)
    tensors = _open_tensors(Path(model_dir))
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        value = _assemble(name, config, tensors, model)
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor for {name} has shape {list(value.shape)} but config.json implies {list(param.shape)}"
            )
        state[name] = value.to(device=device, dtype=config.torch_dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    for buf_name, buf in list(model.named_buffers()):
        module_name, _, attr = buf_name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._buffers[attr] = _rebuild_buffer(model, buf_name, device)
    unused = tensors.unused(skip_experts=expert_ids is not None)
    if unused:
        log.warning("checkpoint %s has %d tensors tideflow does not use, e.g. %s", model_dir, len(unused), unused[0])
    # the layout the kernels routed now read fastest: serving routes them before it loads the model
    tiled = [moe.experts.use_tiles() for moe in model.moe_layers()]
    if any(tiled):
        log.info("expert weights kept in the tiled layout the routed moe_experts streams fastest")
    packed = pack_linears(model)
    if packed:
        log.info("%d projections packed for oneDNN (measured faster here than F.linear)", packed)
    del state  # its tensors are the loaded weights: move_weights frees each once it is copied
    arena = move_weights(model)
    if arena is not None:
        log.info("weights: %.0f MB in one arena, %.0f MB of it in huge pages", arena.size / 1e6, arena.huge_bytes / 1e6)
    return model.eval()


def _rebuild_buffer(model: MoEForCausalLM, name: str, device) -> torch.Tensor:
    """Non-persistent buffers were created on the meta device; compute them for real."""
    config = model.config
    if name == "cos_sin":
        from engine.model.rotary import cos_sin_table

        return cos_sin_table(config.head_dim, config.context_length, config.rope_theta, device)
    if name.endswith("local_of"):
        experts = model.get_submodule(name.rpartition(".")[0])
        local_of = torch.full((config.num_experts,), -1, dtype=torch.int64)
        for slot, logical in enumerate(experts.local_experts):
            if local_of[logical] < 0:
                local_of[logical] = slot
        return local_of.to(device)
    raise CheckpointError(f"internal: no rule to rebuild buffer {name}")


class _Tensors:
    """Name -> file index over all shards, tracking which names were consumed."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.used: set[str] = set()
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        self.used.add(name)
        handle = self._handles.get(path) or self._handles.setdefault(path, safe_open(str(path), "pt"))
        return handle.get_tensor(name)

    def has(self, name: str) -> bool:
        return name in self.files

    def unused(self, skip_experts: bool = False) -> list[str]:
        """Names never read; a rank loading only its experts expects the other experts unread."""
        return sorted(n for n in self.files if n not in self.used and not n.endswith(IGNORED_SUFFIXES)
                      and not (skip_experts and ".experts." in n))


def _open_tensors(model_dir: Path) -> _Tensors:
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{model_dir} holds no *.safetensors files")
    files: dict[str, Path] = {}
    for path in paths:
        try:
            with safe_open(str(path), "pt") as handle:
                for key in handle.keys():
                    files[key] = path
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path.name} is not a readable safetensors file ({exc}); re-download or re-publish it") from None
    return _Tensors(files)


def _shard_experts(model: MoEForCausalLM, expert_ids: Sequence[Sequence[int]]) -> None:
    """Replace each MoE layer's experts (on the meta device) with just the listed slots."""
    config = model.config
    if len(expert_ids) != config.num_layers:
        raise CheckpointError(f"expert_ids has {len(expert_ids)} entries; the model has {config.num_layers} layers")
    for index, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SparseMoE):
            continue
        ids = [int(e) for e in expert_ids[index]]
        if not ids or min(ids) < 0 or max(ids) >= config.num_experts:
            raise CheckpointError(f"expert_ids[{index}] must list experts in [0, {config.num_experts}), got {ids}")
        layer.mlp.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    config.torch_dtype, local=ids)


def _assemble(name: str, config: ModelConfig, t: _Tensors, model: MoEForCausalLM) -> torch.Tensor:
    """Our parameter `name` from the HF tensors (stacking experts, fusing gate+up)."""
    parts = name.split(".")
    if name == "embed.weight":
        return t.get("model.embed_tokens.weight")
    if name == "norm.weight":
        return t.get("model.norm.weight")
    if name == "lm_head.weight":
        return t.get("lm_head.weight")
    layer = int(parts[1])
    pre = f"model.layers.{layer}."
    rest = ".".join(parts[2:])
    mixtral = config.architecture == "MixtralForCausalLM"
    moe = pre + ("block_sparse_moe." if mixtral else "mlp.")
    simple = {
        "input_norm.weight": pre + "input_layernorm.weight",
        "post_attn_norm.weight": pre + "post_attention_layernorm.weight",
        "attn.q_norm.weight": pre + "self_attn.q_norm.weight",
        "attn.k_norm.weight": pre + "self_attn.k_norm.weight",
        "mlp.gate.weight": moe + "gate.weight",
        "mlp.shared_gate.weight": moe + "shared_expert_gate.weight",
    }
    if rest in simple:
        return t.get(simple[rest])
    if rest.startswith("attn.") and rest.endswith(("_proj.weight", "_proj.bias")):
        return t.get(pre + "self_attn." + rest[len("attn."):])
    if rest in ("mlp.experts.w13", "mlp.experts.w2"):
        held = model.layers[layer].mlp.experts.local_experts
        if rest == "mlp.experts.w2":
            down = "w2" if mixtral else "down_proj"
            return torch.stack([t.get(f"{moe}experts.{e}.{down}.weight") for e in held])
        gate, up = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
        return torch.stack([
            torch.cat((t.get(f"{moe}experts.{e}.{gate}.weight"), t.get(f"{moe}experts.{e}.{up}.weight")))
            for e in held
        ])
    mlp_prefix = {"mlp.gate_up.weight": pre + "mlp.", "mlp.down.weight": pre + "mlp.",
                  "mlp.shared.gate_up.weight": moe + "shared_expert.", "mlp.shared.down.weight": moe + "shared_expert."}
    if rest in mlp_prefix:
        base = mlp_prefix[rest]
        if rest.endswith("gate_up.weight"):
            return torch.cat((t.get(base + "gate_proj.weight"), t.get(base + "up_proj.weight")))
        return t.get(base + "down_proj.weight")
    raise CheckpointError(f"internal: no checkpoint mapping for parameter {name}")
