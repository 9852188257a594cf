"""The ops the engine calls: per call, the compiled build for its tensors' device when one is loaded, the torch
reference otherwise."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Callable

from tideflow_kernels import reference
from tideflow_kernels.spec import OP_NAMES

log = logging.getLogger(__name__)

DEVICE_TYPES = ("cpu", "cuda")  # a compiled build serves one of these; any other device gets the reference

# op -> device type -> the compiled function routed for tensors on that device (absent: the torch reference)
_compiled: dict[str, dict[str, Callable]] = {name: {} for name in OP_NAMES}


def use_compiled(name: str, impl: ModuleType | Callable, device: str = "cpu") -> None:
    """Route op `name`, for tensors on `device` ('cpu' or 'cuda'), to a compiled function (or a module's
    function of that name). The CPU build and the CUDA build are routed side by side: each call goes to
    the build of its tensors' device, so a CPU build is never handed CUDA tensors."""
    if device not in DEVICE_TYPES:
        raise ValueError(f"compiled ops serve {' or '.join(DEVICE_TYPES)} tensors, not {device!r}")
    fn = getattr(impl, name) if isinstance(impl, ModuleType) else impl
    if _compiled[name].get(device) is not fn:  # logged once per switch, not per call
        log.info("kernels: using compiled %s for %s tensors from %s", name, device, getattr(fn, "__module__", impl))
    _compiled[name][device] = fn


def use_reference(name: str | None = None, device: str | None = None) -> None:
    """Route one op (or all), for one device type (or all), back to the torch reference."""
    for n in OP_NAMES if name is None else (name,):
        for d in DEVICE_TYPES if device is None else (device,):
            _compiled[n].pop(d, None)


# the CPU build's bind_threads (thread_binding.h), set when a CPU build is loaded; None: nothing can pin threads
_thread_binder: Callable[[list[int]], list[int]] | None = None


def use_thread_binder(fn: Callable[[list[int]], list[int]] | None) -> None:
    global _thread_binder
    _thread_binder = fn


def bind_threads(cpus: list[int]) -> list[int] | None:
    """Pin the calling thread's OpenMP team, thread i to cpus[i]; the CPUs they run on, or None when no CPU
    build is loaded (nothing is pinned)."""
    return None if _thread_binder is None else list(_thread_binder(cpus))


def implementation(name: str, device: str = "cpu") -> str:
    """'reference' or the compiled module's name for tensors on `device`, for logs and tests."""
    fn = _compiled[name].get(device)
    return "reference" if fn is None else getattr(fn, "__module__", "compiled")


def _for(name: str, tensor) -> Callable:
    return _compiled[name].get(tensor.device.type) or getattr(reference, name)


def rms_norm(x, weight, eps, residual=None):
    return _for("rms_norm", x)(x, weight, eps, residual)


def rotary_embedding(q, k, positions, cos_sin):
    return _for("rotary_embedding", q)(q, k, positions, cos_sin)


def topk_gating(logits, k, renormalize):
    return _for("topk_gating", logits)(logits, k, renormalize)


def moe_experts(x, w13, w2, topk_weights, topk_ids, tiled=False):
    """`tiled`: w13 and w2 are in the tiled layout (tideflow_kernels.tiles); every implementation reads both."""
    return _for("moe_experts", x)(x, w13, w2, topk_weights, topk_ids, tiled)


def expert_tiles_fit(w13, w2) -> bool:
    """Whether the moe_experts routed for these weights reads them fastest tiled (a CPU build with AMX, bf16)."""
    fits = getattr(_compiled["moe_experts"].get(w13.device.type), "tiles_fit", None)
    return fits is not None and fits(w13, w2)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    return _for("paged_decode_attention", q)(q, k_cache, v_cache, block_tables, context_lens, scale)
