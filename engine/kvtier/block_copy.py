"""Copies of single KV blocks between the cache tensors and bytes, one record per block (the tiers keep blocks one
by one: engine.kvtier.tiered); each direction is one copy per layer for all the blocks at once."""

from __future__ import annotations

import torch

from engine.model.paged import KVCache


def block_nbytes(kv_cache: KVCache) -> int:
    """Bytes of one block's K and V across every layer."""
    k = kv_cache[0][0]
    return 2 * len(kv_cache) * k[0].numel() * k.element_size()


def export_each(kv_cache: KVCache, block_ids: list[int]) -> list[bytes]:
    """Each block's K and V of every layer as bytes of its own (layout [layer, K|V, ...]): blocks kept one by one
    (engine.kvtier) are written and read apart."""
    k0 = kv_cache[0][0]
    per_block = block_nbytes(kv_cache)
    buf = torch.empty((len(block_ids), per_block), dtype=torch.uint8)
    dest = buf.view(k0.dtype).view(len(block_ids), len(kv_cache), 2, *k0.shape[1:])
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_cache):
        dest[:, layer, 0].copy_(k.index_select(0, index))
        dest[:, layer, 1].copy_(v.index_select(0, index))
    return [row.numpy().tobytes() for row in buf]


def import_each(kv_cache: KVCache, block_ids: list[int], payloads: list[bytes | memoryview]) -> None:
    """Write `export_each` payloads into `block_ids`, one copy per layer for all of them."""
    k0 = kv_cache[0][0]
    per_block = block_nbytes(kv_cache)
    if any(len(p) != per_block for p in payloads):
        raise ValueError(f"a block of this cache is {per_block} bytes")
    data = bytearray(b"".join(payloads))
    parts = torch.frombuffer(data, dtype=torch.uint8).view(k0.dtype).view(len(block_ids), len(kv_cache), 2,
                                                                           *k0.shape[1:]).to(k0.device)
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    for layer, (k, v) in enumerate(kv_cache):
        k.index_copy_(0, index, parts[:, layer, 0])
        v.index_copy_(0, index, parts[:, layer, 1])
