"""Compiled CPU MoE experts (sort by expert, SwiGLU grouped GEMM, weighted scatter)."""

from __future__ import annotations

import torch

from tideflow_kernels.guard import expect


def make(lib):
    op = lib.moe_experts

    def moe_experts(x, w13, w2, topk_weights, topk_ids, tiled=False):
        expect("moe_experts", "cpu", {"x": x, "w13": w13, "w2": w2}, {"topk_weights": topk_weights, "topk_ids": topk_ids})
        return op(x, w13, w2, topk_weights, topk_ids, tiled)

    def tiles_fit(w13, w2) -> bool:
        """Whether this build reads these weights on tiles (bf16 on AMX, fp32 on AVX-512), so the tiled layout is
        the fast one."""
        if w13.dtype not in (torch.bfloat16, torch.float32):
            return False
        return lib.moe_tiles_fit(w13.shape[2], w2.shape[2], w13.dtype == torch.bfloat16)

    moe_experts.tiles_fit = tiles_fit
    return moe_experts
