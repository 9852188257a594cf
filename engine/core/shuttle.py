"""The shuttle window: arrivals gather into one departure instead of trickling into the batch.

A departure leaves when the window (`max_wait_s`, counted from its first passenger) closes or
when it is full (token or sequence budget), whichever comes first. Prefilling a burst together
costs one weight pass instead of one per arrival; a window of 0 dispatches every arrival at once.

The window is worth its wait only when companions are likely: a lone arrival (none other in the last
`lone_after_s`) departs at once instead of paying the whole window in time to first token for nobody.
Arrivals that come close together still gather: the second of a burst opens a window that waits.
"""

from __future__ import annotations

from engine.core.sequence import Sequence


class ShuttleWindow:
    def __init__(self, max_wait_s: float, max_tokens: int, max_seqs: int, lone_after_s: float | None = None) -> None:
        self.max_wait_s = max_wait_s
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.lone_after_s = lone_after_s  # None: every window waits max_wait_s
        self.passengers: list[Sequence] = []
        self.opened_at: float | None = None
        self.wait_s = max_wait_s  # of the open window: max_wait_s, or 0 for a lone first passenger
        self.last_arrival: float | None = None
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.passengers)

    def board(self, seq: Sequence, now: float) -> None:
        if not self.passengers:
            self.opened_at = now
            self.wait_s = 0.0 if self._lone(now) else self.max_wait_s
        self.passengers.append(seq)
        self.tokens += seq.num_tokens
        self.last_arrival = now if self.last_arrival is None else max(self.last_arrival, now)

    def _lone(self, now: float) -> bool:
        """No other arrival in the last lone_after_s (or none yet): nobody is likely to join this one."""
        if self.lone_after_s is None:
            return False
        return self.last_arrival is None or now - self.last_arrival > self.lone_after_s

    @property
    def full(self) -> bool:
        return self.tokens >= self.max_tokens or len(self.passengers) >= self.max_seqs

    @property
    def closes_at(self) -> float | None:
        """When the open window departs by time, or None while it is empty."""
        return None if self.opened_at is None else self.opened_at + self.wait_s

    def due(self, now: float) -> bool:
        return bool(self.passengers) and (self.full or now >= self.closes_at)

    def depart(self) -> list[Sequence]:
        out, self.passengers, self.opened_at, self.tokens = self.passengers, [], None, 0
        return out

    def remove(self, request_id: str) -> Sequence | None:
        """Take a cancelled passenger off before departure."""
        for i, seq in enumerate(self.passengers):
            if seq.request_id == request_id:
                del self.passengers[i]
                self.tokens -= seq.num_tokens
                if not self.passengers:
                    self.opened_at = None
                return seq
        return None
