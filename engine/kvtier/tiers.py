"""The tiers below the device pool, behind one interface: G2 host memory, G3 a local directory, G4 a shared store.

Host memory keeps block tensors; disk and the store keep whole block records (engine.kvtier.keys.encode); all
under the blocks' namespaced keys. Host memory and the
directory bound their size and age themselves (LRU, TTL); the shared store is bounded by the release pipeline (an S3
lifecycle rule, or the kv-gc deployment). A Redis- or Mooncake-class store fits the same five calls.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

import torch

from engine.weights.errors import WeightsError
from engine.weights.store import ObjectStore
from engine.weights.urls import open_store


class TierUnavailable(Exception):
    """The tier could not be read or written (a store that does not answer): the block is recomputed."""


class BlockTier(Protocol):
    name: str
    evictions: int  # blocks dropped for room, counted since start
    expirations: int  # blocks dropped for age

    def get(self, key: str): ...
    def put(self, key: str, value) -> list[str]:
        """Keep `value` under `key`; the keys dropped to make room."""
    def drop(self, key: str) -> None: ...
    def has(self, key: str) -> bool | None:
        """True/False where the tier knows without a round trip; None where only a read can tell (the store)."""
    def used_bytes(self) -> int | None: ...
    def expire(self, now: float) -> list[str]:
        """Drop what is older than the tier's TTL; the keys dropped."""


class _LRU:
    """key -> (size, last use), oldest use first; the caller holds the lock."""

    def __init__(self, capacity: int, ttl_s: float | None) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self.entries: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.used = 0

    def touch(self, key: str, now: float) -> bool:
        """Mark a use; False (and forgotten) when the entry is absent or has expired."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        if self.ttl_s is not None and now - entry[1] > self.ttl_s:
            self.forget(key)
            return False
        self.entries[key] = (entry[0], now)
        self.entries.move_to_end(key)
        return True

    def add(self, key: str, size: int, now: float) -> list[str]:
        """Record `key`; the keys to drop (oldest first) so that everything fits."""
        self.forget(key)
        self.entries[key] = (size, now)
        self.used += size
        dropped = []
        while self.used > self.capacity and len(self.entries) > 1:
            oldest = next(iter(self.entries))
            self.forget(oldest)
            dropped.append(oldest)
        return dropped

    def forget(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry[0]

    def stale(self, now: float) -> list[str]:
        if self.ttl_s is None:
            return []
        return [k for k, (_, used) in self.entries.items() if now - used > self.ttl_s]


class HostTier:
    """G2: block tensors in this process's memory, as exported (no record, no checksum: the bytes never left the
    process; they get both on their way to disk or the store). Safe from any thread (the engine reads, fetch threads
    write)."""

    name = "host"

    def __init__(self, capacity: int, ttl_s: float | None) -> None:
        self._lock = threading.Lock()
        self._lru = _LRU(capacity, ttl_s)
        self._blocks: dict[str, torch.Tensor] = {}
        self.evictions = self.expirations = 0

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            if not self._lru.touch(key, time.monotonic()):
                if self._blocks.pop(key, None) is not None:
                    self.expirations += 1
                return None
            return self._blocks[key]

    def put(self, key: str, block: torch.Tensor) -> list[str]:
        with self._lock:
            self._blocks[key] = block
            dropped = self._lru.add(key, block.nbytes, time.monotonic())
            for gone in dropped:
                del self._blocks[gone]
            self.evictions += len(dropped)
        return dropped

    def drop(self, key: str) -> None:
        with self._lock:
            self._lru.forget(key)
            self._blocks.pop(key, None)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def used_bytes(self) -> int:
        return self._lru.used

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def expire(self, now: float) -> list[str]:
        with self._lock:
            stale = self._lru.stale(now)
            for key in stale:
                self._lru.forget(key)
                del self._blocks[key]
            self.expirations += len(stale)
        return stale


class DiskTier:
    """G3: one file per block under a local directory; what is there at start is indexed (oldest write first) and
    served, so a restarted member keeps its disk cache."""

    name = "disk"

    def __init__(self, root: Path, capacity: int, ttl_s: float | None) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._lru = _LRU(capacity, ttl_s)
        self._names = itertools.count()
        self.evictions = self.expirations = 0
        found = []
        for folder, _, files in os.walk(root):
            for name in files:
                path = Path(folder) / name
                if ".tmp." in name:  # a write that a crash cut short
                    path.unlink(missing_ok=True)
                    continue
                st = path.stat()
                found.append((st.st_mtime, path.relative_to(root).as_posix(), st.st_size))
        now_wall, now = time.time(), time.monotonic()
        for mtime, key, size in sorted(found):
            for dropped in self._lru.add(key, size, now - max(0.0, now_wall - mtime)):
                self._unlink(dropped)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _unlink(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            known = self._lru.touch(key, time.monotonic())
        if not known:
            return None
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:  # removed behind our back (another member sharing the directory, an operator)
            with self._lock:
                self._lru.forget(key)
            return None

    def put(self, key: str, record: bytes) -> list[str]:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}.{next(self._names)}")
        tmp.write_bytes(record)
        os.replace(tmp, path)
        with self._lock:
            dropped = self._lru.add(key, len(record), time.monotonic())
            self.evictions += len(dropped)
        for key_dropped in dropped:
            self._unlink(key_dropped)
        return dropped

    def drop(self, key: str) -> None:
        with self._lock:
            self._lru.forget(key)
        self._unlink(key)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._lru.entries

    def used_bytes(self) -> int:
        return self._lru.used

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._lru.entries)

    def expire(self, now: float) -> list[str]:
        with self._lock:
            stale = self._lru.stale(now)
            for key in stale:
                self._lru.forget(key)
            self.expirations += len(stale)
        for key in stale:
            self._unlink(key)
        return stale


class StoreTier:
    """G4: an object store every member of the fleet reads and writes (S3, MinIO, or a shared directory)."""

    name = "store"

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.evictions = self.expirations = 0

    @classmethod
    def open(cls, url: str, timeout_s: float) -> "StoreTier":
        return cls(open_store(url, timeout_s=timeout_s, max_attempts=1))

    def get(self, key: str) -> bytes | None:
        try:
            return self.store.read_bytes(key)
        except (WeightsError, OSError) as exc:
            raise TierUnavailable(f"store {self.store.url}: {exc}") from None

    def put(self, key: str, record: bytes) -> list[str]:
        try:
            self.store.write_bytes(key, record)
        except (WeightsError, OSError) as exc:
            raise TierUnavailable(f"store {self.store.url}: {exc}") from None
        return []

    def drop(self, key: str) -> None:
        try:
            self.store.delete(key)
        except (WeightsError, OSError) as exc:
            raise TierUnavailable(f"store {self.store.url}: {exc}") from None

    def has(self, key: str) -> None:
        return None

    def used_bytes(self) -> None:
        return None

    def expire(self, now: float) -> list[str]:
        """Objects in the store expire by the pipeline's lifecycle rule or kv-gc, not per member."""
        return []
