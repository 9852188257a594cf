"""bf16 projections on the CPU with their weights packed once, at load, into oneDNN's blocked layout.

`F.linear` on bf16 CPU tensors runs oneDNN's matmul, which reorders the plain [out, in] weight into its
blocked layout on every call. Packing each weight once skips that reorder, the way vLLM's CPU backend
keeps its linear weights. `python benchmarks/dense_linear.py` times both on the default model's
projection shapes (1.2-1.6x per call on a 2-core AMX host); in the engine (bf16, 2 cores, A/B twice)
32-stream decode went 1914-1975 -> 1996-2084 tok/s and batch-1 decode 186-198 -> 209-216 tok/s.

The packing uses torch's own oneDNN ops (the ones its compiler's CPU freezing pass uses). Each packed
layer is checked against `F.linear` on a random input before it replaces the plain one; a torch without
those ops, or a layer that disagrees, stays plain (logged).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# the batch size oneDNN tunes the packed layout for; 1 (decode) measured at least as fast as 32 at every
# batch the engine runs (1, 32 and 128 rows)
PACKED_FOR_ROWS = 1
TOLERANCE = 2e-2  # relative to the largest output, as the compiled ops' bf16 checks


def packing_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))


class PackedLinear(nn.Module):
    """An nn.Linear's product with the weight held packed (the plain weight is dropped)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_FOR_ROWS)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 CPU nn.Linear of `model` whose weight is its own (not tied to an embedding) with a
    PackedLinear that computes the same; returns how many were replaced."""
    if not packing_available():
        return 0
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or id(child.weight) in shared:
                continue
            if child.weight.dtype != torch.bfloat16 or child.weight.device.type != "cpu":
                continue
            packed = _checked(child)
            if packed is not None:
                setattr(parent, name, packed)
                replaced += 1
    return replaced


def _checked(linear: nn.Linear) -> PackedLinear | None:
    try:
        packed = PackedLinear(linear)
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        with torch.inference_mode():
            got, want = packed(x).float(), F.linear(x, linear.weight, linear.bias).float()
    except RuntimeError as exc:
        log.warning("linear %s stays plain: oneDNN could not pack it (%s)", tuple(linear.weight.shape), exc)
        return None
    error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
    if not error <= TOLERANCE:
        log.warning("linear %s stays plain: packed result off by %.3g (limit %.3g)", tuple(linear.weight.shape),
                    error, TOLERANCE)
        return None
    return packed
