"""Per-request outcomes per group, kept by the router for the canary judge.

Histograms cannot give a rank test its samples, and Prometheus keeps only their buckets; the router sees every
request's outcome and client-seen latencies, so it keeps the latest `capacity` of them in memory, numbered, and
serves them from a cursor (GET /samples). A request that failed on one group and was retried on another
counts as an error sample for the first group and as the outcome it got for the second.
"""

from __future__ import annotations

import threading
from collections import deque

from pydantic import BaseModel, Field

DEFAULT_CAPACITY = 200_000


class Sample(BaseModel):
    """One request's outcome on one group, as the router measured it (latencies None where not measured)."""

    seq: int = Field(0, description="the router's sample number, increasing from 1")
    group: str
    version: str = ""
    ok: bool
    ttft: float | None = Field(None, description="seconds to the first token, streamed requests")
    tpot: float | None = Field(None, description="seconds per output token after the first")
    e2e: float | None = Field(None, description="seconds from arrival to the last token")


class SamplePage(BaseModel):
    next: int = Field(description="the cursor to ask from next time (the last sample number served, or the newest)")
    dropped: int = Field(0, description="samples after the cursor already dropped from the buffer")
    samples: list[Sample] = Field(default_factory=list)


class SampleLog:
    """A bounded, numbered buffer of samples; appended and read from the router's event loop (the lock keeps
    it whole should a page ever be read from another thread)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._items: deque[Sample] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    def add(self, group: str, version: str, ok: bool, ttft: float | None = None, tpot: float | None = None,
            e2e: float | None = None) -> None:
        with self._lock:
            self._seq += 1
            self._items.append(Sample(seq=self._seq, group=group, version=version, ok=ok, ttft=ttft, tpot=tpot, e2e=e2e))

    def page(self, after: int, groups: set[str] | None, limit: int) -> SamplePage:
        """Samples numbered above `after` (of `groups`, or all), oldest first, at most `limit`. The buffer is
        walked in place from the cursor (samples are numbered without gaps, so the cursor gives the index), and
        a deque reads fast near its ends, where a poller's cursor lies."""
        with self._lock:
            newest = self._seq
            if after > newest:  # a cursor from before this router restarted: everything here is new to it
                after = 0
            if limit == 0:  # where the log stands now
                return SamplePage(next=newest)
            oldest = self._items[0].seq if self._items else newest + 1
            dropped = max(0, oldest - after - 1) if after < newest else 0
            out: list[Sample] = []
            index, cursor = max(0, after - oldest + 1), max(after, oldest - 1)
            while index < len(self._items) and len(out) < limit:
                sample = self._items[index]
                cursor = sample.seq
                if groups is None or sample.group in groups:
                    out.append(sample)
                index += 1
            if index >= len(self._items):
                cursor = newest
        return SamplePage(next=cursor, dropped=dropped, samples=out)
