"""New requests parked while their prompt's blocks come up from disk or the shared store (engine.kvtier): each waits
until its fetch ends, and at most what computing those blocks is estimated to cost, or FETCH_WAIT_FLOOR_S where that
is less. Engine thread only."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Callable

from engine.core.block_hash import chain_hashes
from engine.core.sequence import Sequence
from engine.kvtier.tiered import TieredKV


# The least a started fetch is waited for. A fetch starts only where reading a block was measured to beat computing it
# (TieredKV.worth_loading), so its expected time is under the compute estimate; but on a busy host one scheduler
# hiccup outlasts the compute estimate of a few small blocks (milliseconds), and a fetch given up for that costs the
# read and the compute both.
FETCH_WAIT_FLOOR_S = 0.05


@dataclass
class _Fetch:
    seq: Sequence
    future: concurrent.futures.Future
    deadline: float  # time.monotonic() after which it is scheduled whatever came up


class PendingFetches:
    def __init__(self, tiers: TieredKV | None, block_size: int, wake: Callable[[], None]) -> None:
        """`tiers` None, or without disk and store: nothing is ever parked. `wake` runs when a fetch ends."""
        self.tiers = tiers if tiers is not None and tiers.has_lower() else None
        self.block_size, self.wake = block_size, wake
        self._parked: dict[str, _Fetch] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, seq: Sequence, cached: dict[int, int], s_per_token: float | None) -> bool:
        """Start bringing up the prompt's blocks that neither the pool (`cached`) nor host memory holds; True when
        the request waits for them, False when there is nothing to wait for."""
        tiers, bs = self.tiers, self.block_size
        if tiers is None:
            return False
        hashes = chain_hashes(seq.tokens, bs, seq.block_extras, None, 0, (seq.num_tokens - 1) // bs)
        held = 0
        while held < len(hashes) and (hashes[held] in cached or tiers.held_in_host(hashes[held])):
            held += 1
        future = tiers.prefetch(hashes[held:], s_per_token, self.wake)
        if future is None:
            return False
        longest = tiers.config.store_timeout_s
        wait = longest if s_per_token is None else \
            min(longest, max(FETCH_WAIT_FLOOR_S, s_per_token * bs * (len(hashes) - held)))
        self._parked[seq.request_id] = _Fetch(seq, future, time.monotonic() + wait)
        return True

    def due(self, now: float) -> list[Sequence]:
        """The parked requests whose fetch ended or whose wait is over, no longer parked."""
        ready = [rid for rid, f in self._parked.items() if f.future.done() or now >= f.deadline]
        return [self._parked.pop(rid).seq for rid in ready]

    def drop(self, request_id: str) -> Sequence | None:
        fetch = self._parked.pop(request_id, None)
        return None if fetch is None else fetch.seq

    def next_deadline(self) -> float | None:
        return min((f.deadline for f in self._parked.values()), default=None)
