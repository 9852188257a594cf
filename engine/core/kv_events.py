"""What KV blocks this member holds, as a feed of events the router reads with a cursor (engine.router.kv_index).

Each event says that blocks (by their chained hashes) were stored in or removed from one tier: "device" (the KV
cache), "host", "disk", or "store" (the shared store, which every member of the fleet can read). The log is
bounded; a reader whose cursor fell behind it, or who read another life of this process (another epoch), is told to
reset and gets a snapshot of what is held now.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Callable

from pydantic import BaseModel, Field

TIERS = ("device", "host", "disk", "store")
KEPT_EVENTS = 8192


class KVEvent(BaseModel):
    seq: int
    kind: str = Field(pattern="^(stored|removed)$")
    tier: str
    hashes: list[int]


class KVEventPage(BaseModel):
    """One read of the feed: the events after the reader's cursor, or (reset) everything held now."""

    epoch: str = Field(description="this process's life: a cursor of another epoch is void")
    seq: int = Field(description="the cursor to read after next time")
    reset: bool = Field(False, description="the reader must forget what it knew of this member; `held` is all of it")
    held: dict[str, list[int]] = Field(default_factory=dict, description="reset only: tier -> hashes held now")
    events: list[KVEvent] = Field(default_factory=list)


class KVEventLog:
    """Written by the engine thread and the tiers' threads, read by the HTTP front; every call takes the lock."""

    def __init__(self, capacity: int = KEPT_EVENTS) -> None:
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._seq = 0

    def renew(self) -> None:
        """The KV cache was replaced (a standby's released and allocated again): readers start over from a snapshot."""
        with self._lock:
            self.epoch = uuid.uuid4().hex
            self._events.clear()

    def stored(self, tier: str, hashes: list[int]) -> None:
        self._add("stored", tier, hashes)

    def removed(self, tier: str, hashes: list[int]) -> None:
        self._add("removed", tier, hashes)

    def _add(self, kind: str, tier: str, hashes: list[int]) -> None:
        if not hashes:
            return
        with self._lock:
            self._seq += 1
            self._events.append(KVEvent(seq=self._seq, kind=kind, tier=tier, hashes=list(hashes)))

    def page(self, epoch: str, after: int, held: Callable[[], dict[str, list[int]]], limit: int = 512) -> KVEventPage:
        """Events after `after` of `epoch`; a reset with `held()` when they are not all still here."""
        with self._lock:
            seq, now_epoch = self._seq, self.epoch
            oldest = self._events[0].seq if self._events else seq + 1
            if epoch == self.epoch and after >= oldest - 1 and after <= seq:
                events = [e for e in self._events if e.seq > after][:limit]
                return KVEventPage(epoch=self.epoch, seq=events[-1].seq if events else seq, events=events)
        return KVEventPage(epoch=now_epoch, seq=seq, reset=True, held=held())
