"""Compiled CPU MoE experts (sort by expert, SwiGLU grouped GEMM, weighted scatter)."""

from __future__ import annotations

from tideflow_kernels.guard import expect


def make(lib):
    op = lib.moe_experts

    def moe_experts(x, w13, w2, topk_weights, topk_ids):
        expect("moe_experts", "cpu", {"x": x, "w13": w13, "w2": w2}, {"topk_weights": topk_weights, "topk_ids": topk_ids})
        return op(x, w13, w2, topk_weights, topk_ids)

    return moe_experts
