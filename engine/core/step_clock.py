"""How long the engine's current step (a pass of its loop: scheduling, the model step, its outputs) has run against
how long it should: what tells a member that is busy from one that is stuck.

Why: a router must tell a member that stopped producing (a hung step, a stopped process, a lost network) from one
that is computing a long prompt, within a couple of seconds and without a timeout long enough for the slowest
prompt. Only the engine knows which: its steps so far say how long one takes. The member's streams carry a
heartbeat while `live()` holds (engine/server/app.py), and the router gives up on a stream that sends nothing for
its stall timeout (engine/router/proxy.py).

A step's budget is STALL_FACTOR x what it should take: the longest recent step, or its tokens at the longest
recent time per token of a prefill-sized step, whichever is more (a 2,048-token chunk after a run of one-token
decodes must not count as stuck). Before any prefill-sized step was seen, a token is taken to cost
DEFAULT_S_PER_TOKEN, generous for a CPU, so a first long prompt is never taken for a hang.
"""

from __future__ import annotations

import time

STALL_FACTOR = 4.0
FLOOR_S = 0.25  # no budget is shorter: a collection pause or a descheduled thread is not a hang
DEFAULT_S_PER_TOKEN = 0.005
PREFILL_TOKENS = 64  # steps with at least this many tokens teach the time per token
DECAY = 0.95  # per step: a long step long ago stops counting after a few dozen short ones


class StepClock:
    """Written by the engine thread (begin/size/end around each pass), read by any thread (floats: no lock). A
    lockstep rank waiting in its peers' collective is between passes: a stopped peer is the supervisor's to see
    (its member stops answering /ready)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.tokens = 0
        self.steps = 0
        self.recent_s = 0.0
        self.s_per_token = DEFAULT_S_PER_TOKEN
        self._learned = False

    def begin(self, tokens: int = 0) -> None:
        """A pass of the engine loop starts (its step's tokens are known once it is planned: size())."""
        self.tokens = tokens
        self.started = time.monotonic()

    def size(self, tokens: int) -> None:
        self.tokens = tokens

    def end(self, record: bool = True) -> float:
        """The pass is over; `record=False` for a pass that planned nothing (its time teaches nothing). Returns
        how long it took (0 when no pass was timed)."""
        started = self.started
        if started is None:
            return 0.0
        took = time.monotonic() - started
        self.started = None
        if not record:
            return took
        self.steps += 1
        self.recent_s = max(took, self.recent_s * DECAY)
        if self.tokens >= PREFILL_TOKENS:
            per_token = took / self.tokens
            self.s_per_token = per_token if not self._learned else max(per_token, self.s_per_token * DECAY)
            self._learned = True
        return took

    def budget_s(self) -> float:
        """How long the current step may run before the engine counts as stuck."""
        return max(FLOOR_S, STALL_FACTOR * max(self.recent_s, self.tokens * self.s_per_token))

    def stepping_s(self) -> float:
        """How long the current step has run (0 between steps)."""
        started = self.started
        return 0.0 if started is None else time.monotonic() - started

    def live(self) -> bool:
        """Between steps, or in a step still within its budget."""
        return self.stepping_s() <= self.budget_s()
