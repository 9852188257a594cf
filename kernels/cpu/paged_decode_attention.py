"""Compiled CPU paged decode attention (GQA, block table)."""

from __future__ import annotations


def make(lib):
    op = lib.paged_decode_attention

    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
        return op(q, k_cache, v_cache, block_tables, context_lens, float(scale))

    return paged_decode_attention
