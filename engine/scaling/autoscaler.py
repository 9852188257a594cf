"""The long-running autoscaler: one decision per tick (metrics + schedule within bounds), applied via the warm pool.

The Prefect autoscaler flow runs this loop; the cron deployments of `tidal_scale` call
`WarmPool.scale_to` directly. Every decision is kept as an event and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from pydantic import BaseModel, Field

from engine.scaling.policy import Decision, MetricScaler, Observation, ScalingPolicy, combine
from engine.scaling.pool import ScaleResult, WarmPool

log = logging.getLogger(__name__)


class AutoscalerStopped(Exception):
    """Raised by a pool's scale_to when the autoscaler asking was stopped meanwhile: its tick ends quietly."""


class ScalingEvent(BaseModel):
    """One tick: what was seen, what was decided, what scale_to did."""

    decision: Decision
    observation: Observation | None = Field(None, description="None when the policy reads no metrics")
    result: ScaleResult | None = Field(None, description="None when scale_to had nothing to do")


class Autoscaler:
    """`start()` runs `tick()` every `policy.tick_s` on a thread until `stop()`; `clock` gives the wall time
    the schedule reads (a replay passes a compressed day)."""

    def __init__(self, pool: WarmPool, policy: ScalingPolicy, observe: Callable[[], Observation] | None = None,
                 clock: Callable[[], datetime] | None = None, max_events: int = 10_000) -> None:
        if policy.metrics is not None and observe is None:
            raise ValueError("a metric policy needs an observer (observe=...)")
        self.pool, self.policy, self.observe = pool, policy, observe
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self.metric = MetricScaler(policy.metrics) if policy.metrics is not None else None
        self.events: list[ScalingEvent] = []
        self.max_events = max_events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> ScalingEvent:
        """Observe, decide, and scale when the target differs from the current count."""
        now_s = time.monotonic()
        current = self.pool.capacity()
        obs = self.observe() if self.metric is not None else None
        metric = self.metric.desired(current, obs, now_s) if self.metric is not None else None
        decision = combine(self.policy, current, metric, self.clock())
        event = ScalingEvent(decision=decision, observation=obs)
        result = self.pool.scale_to(decision.target, decision.floor)  # also refills the warm pool when nothing else changes
        if result.changed:
            event.result = result
        if decision.target != current:
            if self.metric is not None:
                self.metric.changed(time.monotonic())
            log.info("autoscaler: %d -> %d (%s)", current, decision.target, decision.reason)
        self.events.append(event)
        del self.events[: -self.max_events]
        return event

    def start(self) -> "Autoscaler":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tideflow-autoscaler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except AutoscalerStopped:
                break
            except Exception:  # one failed tick (a router restart, a timeout) must not end the loop
                log.exception("autoscaler tick failed; retrying next tick")
            self._stop.wait(self.policy.tick_s)

    @property
    def stopping(self) -> bool:
        """Asked to stop: a tick under way must not carry out its decision (another policy may own the pool)."""
        return self._stop.is_set()

    def stop(self, timeout_s: float = 60.0, wait: bool = True) -> None:
        """Ask the loop to end; with `wait`, join it. Never wait while holding a lock a tick may ask for."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None
