"""The MoE experts as two grouped GEMMs (torch._grouped_mm): the token copies sorted by expert, gate/up for every
expert in one call, SwiGLU, down in one call, and the weighted sum back onto the tokens.

Nothing reads back to the host (the groups' bounds stay on the device), so a decode step using it can be captured
as a CUDA graph; on Hopper the grouped GEMM runs on tensor cores. The kernel build times it against the compiled
kernel and routes moe_experts to the faster one that verifies (tideflow_kernels.build). It takes row-major weights
whose rows are whole multiples of 16 bytes (what torch's grouped GEMM reads); `fits` says whether a call does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tideflow_kernels.tiles import from_tiles

VARIANT = "grouped_mm"


def available() -> bool:
    """Whether the installed torch has the grouped GEMM."""
    return hasattr(torch, "_grouped_mm")


def fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Rows of x, w13 and w2 (hidden and intermediate sizes) are whole multiples of 16 bytes; on CUDA, bf16 on a
    Hopper or newer GPU (what torch's grouped GEMM runs on tensor cores, without reading the groups back)."""
    size = x.element_size()
    if x.shape[1] * size % 16 or w2.shape[2] * size % 16:
        return False
    if x.device.type == "cuda":
        return (x.dtype == w13.dtype == w2.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return True


def sorted_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the T*k token copies: their order sorted by expert (copies of skipped experts, id < 0, last), each group's
    end offset (int32, [num_experts]) and which copies are computed here."""
    flat = topk_ids.reshape(-1).long()
    kept = flat >= 0
    key = torch.where(kept, flat, num_experts)
    order = torch.argsort(key, stable=True)
    # counted by a scatter, not torch.bincount, which reads the ids' range back to the host on CUDA (no capture)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).index_add_(0, key, torch.ones_like(key))
    ends = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    return order, ends, kept.index_select(0, order)


def make(fallback):
    """moe_experts on the grouped GEMM where a call `fits`, on `fallback` (the verified compiled kernel) where it
    does not."""

    def grouped_or_fallback(x, w13, w2, topk_weights, topk_ids, tiled=False):
        if tiled or not fits(x, w13, w2):
            return fallback(x, w13, w2, topk_weights, topk_ids, tiled)
        return moe_experts(x, w13, w2, topk_weights, topk_ids)

    return grouped_or_fallback


def moe_experts(x, w13, w2, topk_weights, topk_ids, tiled=False):
    """Same contract as tideflow_kernels.reference.moe_experts; the rows must `fit`."""
    if tiled:
        w13, w2 = from_tiles(w13), from_tiles(w2)
    tokens, k, inter = x.shape[0], topk_ids.shape[1], w2.shape[2]
    order, ends, kept = sorted_by_expert(topk_ids, w13.shape[0])
    rows = order // k
    copies = x.index_select(0, rows)
    h = torch._grouped_mm(copies, w13.transpose(1, 2), offs=ends)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=ends).float()
    weights = topk_weights.reshape(-1).index_select(0, order).float().unsqueeze(1)
    y = torch.where(kept.unsqueeze(1), y * weights, 0.0)  # rows past the last group are left unwritten by the GEMM
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, y).to(x.dtype)
