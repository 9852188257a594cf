"""CUDA MoE experts: on-device sort by expert, SwiGLU grouped GEMM, atomic weighted scatter."""

from __future__ import annotations

import torch

from tideflow_kernels.cuda.library import check, dtype_code, stream
from tideflow_kernels.errors import KernelInputError
from tideflow_kernels.guard import expect
from tideflow_kernels.tiles import from_tiles


def make(lib):
    def moe_experts(x, w13, w2, topk_weights, topk_ids, tiled=False):
        expect("moe_experts", "cuda", {"x": x, "w13": w13, "w2": w2}, {"topk_weights": topk_weights, "topk_ids": topk_ids})
        if tiled:  # the CPU tiles' layout: this kernel reads rows (the engine tiles only for the CPU build)
            w13, w2 = from_tiles(w13), from_tiles(w2)
        if not x.dtype == w13.dtype == w2.dtype:
            raise KernelInputError(f"moe_experts: x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
        x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
        tw = topk_weights.to(torch.float32).contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        T, H = x.shape
        E, k, inter = w13.shape[0], ids.shape[1], w2.shape[2]
        ws = torch.empty(lib.tf_moe_workspace_bytes(T, k, E, H, inter), dtype=torch.uint8,
                         device=x.device)
        out = torch.empty_like(x)
        check(lib.tf_moe_experts(x.data_ptr(), w13.data_ptr(), w2.data_ptr(), tw.data_ptr(),
                                 ids.data_ptr(), out.data_ptr(), ws.data_ptr(), T, k, E, H, inter,
                                 dtype_code(x), stream()), "moe_experts")
        return out

    return moe_experts
