"""CUDA paged decode attention (block per sequence and head, online softmax)."""

from __future__ import annotations

import torch

from tideflow_kernels.cuda.library import check, dtype_code, stream
from tideflow_kernels.guard import expect


def make(lib):
    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
        expect("paged_decode_attention", "cuda", {"q": q, "k_cache": k_cache, "v_cache": v_cache},
               {"block_tables": block_tables})
        q, kc, vc = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(device=q.device, dtype=torch.int32).contiguous()
        out = torch.empty_like(q)
        B, Hq, D = q.shape
        check(lib.tf_paged_decode_attention(q.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                                            tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
                                            B, Hq, kc.shape[2], D, kc.shape[1], tables.shape[1],
                                            float(scale), dtype_code(q), stream()),
              "paged_decode_attention")
        return out

    return paged_decode_attention
