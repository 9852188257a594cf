"""The ops the engine calls: a compiled build when one is loaded, the torch reference otherwise."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Callable

from kernels import reference

log = logging.getLogger(__name__)

OP_NAMES = ("rms_norm", "rotary_embedding", "topk_gating", "moe_experts", "paged_decode_attention")

_active: dict[str, object] = {name: getattr(reference, name) for name in OP_NAMES}


def use_compiled(name: str, impl: ModuleType | Callable) -> None:
    """Route op `name` to a compiled function, or to a module's function of that name."""
    fn = getattr(impl, name) if isinstance(impl, ModuleType) else impl
    if _active[name] is not fn:  # logged once per switch, not per call
        log.info("kernels: using compiled %s from %s", name, getattr(fn, "__module__", impl))
    _active[name] = fn


def use_reference(name: str | None = None) -> None:
    """Route one op (or all) back to the torch reference."""
    for n in OP_NAMES if name is None else (name,):
        _active[n] = getattr(reference, n)


def implementation(name: str) -> str:
    """'reference' or the compiled module's name, for logs and tests."""
    fn = _active[name]
    return "reference" if fn is getattr(reference, name) else getattr(fn, "__module__", "compiled")


def rms_norm(x, weight, eps, residual=None):
    return _active["rms_norm"](x, weight, eps, residual)


def rotary_embedding(q, k, positions, cos_sin):
    return _active["rotary_embedding"](q, k, positions, cos_sin)


def topk_gating(logits, k, renormalize):
    return _active["topk_gating"](logits, k, renormalize)


def moe_experts(x, w13, w2, topk_weights, topk_ids):
    return _active["moe_experts"](x, w13, w2, topk_weights, topk_ids)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    return _active["paged_decode_attention"](q, k_cache, v_cache, block_tables, context_lens, scale)
