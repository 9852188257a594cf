"""Compiled CPU paged decode attention (GQA, block table)."""

from __future__ import annotations

from tideflow_kernels.guard import expect


def make(lib):
    op = lib.paged_decode_attention

    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
        expect("paged_decode_attention", "cpu", {"q": q, "k_cache": k_cache, "v_cache": v_cache},
               {"block_tables": block_tables, "context_lens": context_lens})
        return op(q, k_cache, v_cache, block_tables, context_lens, float(scale))

    return paged_decode_attention
