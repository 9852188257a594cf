"""CUDA rotate-half rotary embedding (block per token, strided input)."""

from __future__ import annotations

import torch

from tideflow_kernels.cuda.library import check, dtype_code, stream
from tideflow_kernels.guard import expect


def make(lib):
    def one(x, positions, cos_sin):
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        T, H, D = x.shape
        check(lib.tf_rotary_embedding(x.data_ptr(), out.data_ptr(), positions.data_ptr(),
                                      cos_sin.data_ptr(), T, H, D, x.stride(0), x.stride(1),
                                      dtype_code(x), stream()), "rotary_embedding")
        return out

    def rotary_embedding(q, k, positions, cos_sin):
        expect("rotary_embedding", "cuda", {"q": q, "k": k}, {"positions": positions, "cos_sin": cos_sin})
        pos = positions.to(torch.int64).contiguous()
        cs = cos_sin.to(torch.float32).contiguous()
        return one(q, pos, cs), one(k, pos, cs)

    return rotary_embedding
