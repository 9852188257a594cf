"""Compiled CPU rotate-half rotary embedding."""

from __future__ import annotations


def make(lib):
    op = lib.rotary_embedding

    def rotary_embedding(q, k, positions, cos_sin):
        return tuple(op(q, k, positions, cos_sin))

    return rotary_embedding
