"""Compiled CPU rotate-half rotary embedding."""

from __future__ import annotations

from tideflow_kernels.guard import expect


def make(lib):
    op = lib.rotary_embedding

    def rotary_embedding(q, k, positions, cos_sin):
        expect("rotary_embedding", "cpu", {"q": q, "k": k}, {"positions": positions, "cos_sin": cos_sin})
        return tuple(op(q, k, positions, cos_sin))

    return rotary_embedding
