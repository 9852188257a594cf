"""Encoder output cache keyed by content hash, so a repeated image is encoded once."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import torch
from prometheus_client import CollectorRegistry, Counter


def content_hash(pixels: torch.Tensor) -> str:
    """sha256 of the decoded pixels (and their shape): the same picture in any container hits."""
    h = hashlib.sha256(str(tuple(pixels.shape)).encode())
    h.update(pixels.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class EncoderCache:
    """LRU of embeddings [num_patches, hidden] bounded by entry count, with hit/miss counters."""

    def __init__(self, capacity: int = 256, registry: CollectorRegistry | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0
        self._hit_counter = self._miss_counter = None
        if registry is not None:
            self._hit_counter = Counter("tideflow_encoder_cache_hits", "images served from the encoder cache",
                                        registry=registry)
            self._miss_counter = Counter("tideflow_encoder_cache_misses", "images the vision encoder had to run on",
                                         registry=registry)

    def get_or_compute(self, key: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            if self._hit_counter is not None:
                self._hit_counter.inc()
            return self._entries[key]
        self.misses += 1
        if self._miss_counter is not None:
            self._miss_counter.inc()
        value = compute()
        self._entries[key] = value
        if len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)
