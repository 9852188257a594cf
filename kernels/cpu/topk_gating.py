"""Compiled CPU softmax + top-k + renormalise router gating."""

from __future__ import annotations


def make(lib):
    op = lib.topk_gating

    def topk_gating(logits, k, renormalize):
        return tuple(op(logits, int(k), bool(renormalize)))

    return topk_gating
