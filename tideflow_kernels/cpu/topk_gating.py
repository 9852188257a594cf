"""Compiled CPU softmax + top-k + renormalise router gating."""

from __future__ import annotations

from tideflow_kernels.guard import expect


def make(lib):
    op = lib.topk_gating

    def topk_gating(logits, k, renormalize):
        expect("topk_gating", "cpu", {"logits": logits})
        return tuple(op(logits, int(k), bool(renormalize)))

    return topk_gating
