"""CPU projections with their weights packed once, at load, into oneDNN's blocked layout, where that is
measured faster on this host.

`F.linear` on bf16 CPU tensors runs oneDNN's matmul, which reorders the plain [out, in] weight into its
blocked layout on every call; on fp32 it runs the BLAS torch was built with (MKL), whose speed depends on
the processor: on an AMD EPYC (AVX-512, no AMX) the packed oneDNN product of the default model's projections
at 32 rows is 1.6-2.7x faster, while on one shape at batch 1 the plain call wins. So every layer is timed
both ways at load (1 and 32 rows, the decode batches) and packed only when the packed one is faster, the way
vLLM's CPU backend keeps its linear weights in oneDNN's layout. `python benchmarks/dense_linear.py
[--dtype float32]` times both per shape; on a 2-core AMX host (bf16, A/B twice) 32-stream decode went
1914-1975 -> 1996-2084 tok/s and batch-1 decode 186-198 -> 209-216 tok/s.

The packing uses torch's own oneDNN ops (the ones its compiler's CPU freezing pass uses). Each packed
layer is checked against `F.linear` on a random input before it replaces the plain one; a torch without
those ops, or a layer that disagrees, stays plain (logged).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tideflow_kernels.timing import compare_us

log = logging.getLogger(__name__)

# the batch size oneDNN tunes the packed layout for; 1 (decode) measured at least as fast as 32 at every
# batch the engine runs (1, 32 and 128 rows)
PACKED_FOR_ROWS = 1
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}  # relative to the largest output
TIMED_ROWS = (1, 32)  # the batches a layer is timed at: one stream and a full decode batch
TIMED_CALLS = 9  # per side and batch; the median decides


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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s weights in memory: its parameters (each once, tied or not) and the packed projections'
    weights, which are no parameters (a PackedLinear holds oneDNN's blocked copy only)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.packed.numel() * m.packed.element_size() for m in model.modules()
                        if isinstance(m, PackedLinear))


def pack_linears(model: nn.Module) -> int:
    """Replace every bf16 or fp32 CPU nn.Linear of `model` whose weight is its own (not tied to an embedding) with
    a PackedLinear that computes the same, where it is measured faster on this host; returns how many were
    replaced. Layers of one shape are timed once."""
    if not packing_available():
        return 0
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    faster: dict[tuple, bool] = {}  # (dtype, out, in, bias) -> packed measured faster
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or id(child.weight) in shared:
                continue
            if child.weight.dtype not in TOLERANCE or child.weight.device.type != "cpu":
                continue
            packed = _checked(child)
            if packed is None:
                continue
            shape = (child.weight.dtype, *child.weight.shape, child.bias is not None)
            if shape not in faster:
                faster[shape] = packing_pays(child, packed)
            if faster[shape]:
                setattr(parent, name, packed)
                replaced += 1
    return replaced


def packing_pays(linear: nn.Linear, packed: PackedLinear) -> bool:
    """Whether the packed product is faster than `F.linear` on the plain weight, on this host and thread count:
    the medians at 1 and 32 rows, summed (timed alternately, so load from elsewhere hits both)."""
    gen = torch.Generator().manual_seed(0)
    packed_us = plain_us = 0.0
    with torch.inference_mode():
        for rows in TIMED_ROWS:
            x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.dtype)
            ours, theirs = compare_us(packed, linear, (x,), TIMED_CALLS, warmup=2)
            packed_us, plain_us = packed_us + ours, plain_us + theirs
    return packed_us < plain_us


def _checked(linear: nn.Linear) -> PackedLinear | None:
    try:
        packed = PackedLinear(linear)
        x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
        with torch.inference_mode():
            got, want = packed(x).float(), F.linear(x, linear.weight, linear.bias).float()
    except RuntimeError as exc:
        log.warning("linear %s stays plain: oneDNN could not pack it (%s)", tuple(linear.weight.shape), exc)
        return None
    error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
    limit = TOLERANCE[linear.weight.dtype]
    if not error <= limit:
        log.warning("linear %s stays plain: packed result off by %.3g (limit %.3g)", tuple(linear.weight.shape),
                    error, limit)
        return None
    return packed
