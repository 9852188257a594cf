"""Replay a compressed tidal day against a group set under the autoscaler; summarise it per phase."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from drills.load import run_load_drill
from drills.spec import LoadDrillSpec
from engine.group.groupset import LocalGroupSet
from engine.group.spec import InferenceGroup
from engine.scaling.autoscaler import Autoscaler
from engine.scaling.observe import SetObserver
from engine.scaling.policy import ScalingPolicy
from engine.scaling.pool import WarmPool
from harness.tide import CompressedClock, TidalDay

PHASES = ("night", "ramp", "peak", "fall")
KEY_ENV = "TIDEFLOW_TIDAL_KEY"


class PhaseSummary(BaseModel):
    phase: str
    sent: int = Field(ge=0)
    errors: int = Field(ge=0)
    ttft_p99_ms: float | None = None
    groups_mean: float = Field(ge=0, description="mean serving groups while the phase lasted")
    groups_max: int = Field(ge=0)


class IntervalSummary(BaseModel):
    """One virtual hour of the day: what it served, how fast, and what it held."""

    hour: int
    sent: int = Field(ge=0)
    errors: int = Field(ge=0)
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    serving_mean: float = Field(ge=0, description="mean serving groups in the hour")
    standby_mean: float = Field(ge=0, description="mean warm standby groups in the hour")


class TidalReport(BaseModel):
    warm_pool: int = Field(ge=0)
    sent: int = Field(ge=0)
    ok: int = Field(ge=0)
    errors: int = Field(ge=0)
    phases: list[PhaseSummary]
    activations_s: list[float] = Field(default_factory=list)
    cold_starts: int = Field(0, ge=0, description="groups cold-started to serve during the day")
    decisions: int = Field(0, ge=0)
    intervals: list[IntervalSummary] = Field(default_factory=list, description="each virtual hour of the day")


def replay_day(gs: LocalGroupSet, template: InferenceGroup, policy: ScalingPolicy, day: TidalDay, trace: Path,
               settle_timeout_s: float = 300.0) -> TidalReport:
    """Bring the pool up (warm pool filled), replay the trace under the autoscaler, park and stop everything."""
    pool = WarmPool(gs.manager, template, policy.bounds, policy.warm_pool, drain_s=30)
    observer = SetObserver(lambda: [gs.url], gs.client_key, gs.member_key,
                           lambda: [m.endpoint for g in pool.serving() for m in g.status.members if m.endpoint])
    try:
        pool.scale_to(max(policy.bounds.min_groups, 1))
        deadline = time.monotonic() + settle_timeout_s
        while (len(pool.serving()) < 1 or len(pool.standby()) < policy.warm_pool) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.environ[KEY_ENV] = gs.client_key
        spec = LoadDrillSpec(url=gs.url, model="default", api_key_env=KEY_ENV, trace=trace, expectations_suite=None,
                             progress_bar=False, request_timeout_s=120)
        samples: list[tuple[float, int, int]] = []  # (seconds in, serving groups, standby groups)
        done = threading.Event()
        t0 = time.monotonic()
        scaler = Autoscaler(pool, policy, observer, clock=CompressedClock(day, t0)).start()

        def sample() -> None:
            while not done.wait(0.25):
                samples.append((time.monotonic() - t0, len(pool.serving()), len(pool.standby())))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            report = run_load_drill(spec)
        finally:
            done.set()
            scaler.stop()
            sampler.join(timeout=5)
    finally:
        observer.close()
        pool.close(drain_s=10)
    phases = []
    for name in PHASES:
        recs = [r for r in report.requests if day.phase(day.hour_at(r.scheduled_s)) == name]
        ttfts = [r.ttft_ms for r in recs if r.ok and r.ttft_ms is not None]
        counts = [n for t, n, _ in samples if day.phase(day.hour_at(t)) == name]
        phases.append(PhaseSummary(phase=name, sent=len(recs), errors=sum(not r.ok for r in recs),
                                   ttft_p99_ms=float(np.percentile(ttfts, 99)) if ttfts else None,
                                   groups_mean=float(np.mean(counts)) if counts else 0.0,
                                   groups_max=max(counts, default=0)))
    intervals = []
    for hour in range(24):
        recs = [r for r in report.requests if int(day.hour_at(r.scheduled_s)) == hour]
        ok = [r for r in recs if r.ok]
        held = [(n, s) for t, n, s in samples if int(day.hour_at(t)) == hour]
        intervals.append(IntervalSummary(
            hour=hour, sent=len(recs), errors=len(recs) - len(ok),
            ttft_p90_ms=_p90([r.ttft_ms for r in ok]), tpot_p90_ms=_p90([r.tpot_ms for r in ok]),
            serving_mean=float(np.mean([n for n, _ in held])) if held else 0.0,
            standby_mean=float(np.mean([s for _, s in held])) if held else 0.0))
    results = [e.result for e in scaler.events if e.result is not None]
    return TidalReport(warm_pool=policy.warm_pool, sent=report.sent, ok=report.ok, errors=report.error, phases=phases,
                       activations_s=[s for r in results for s in r.activation_s],
                       cold_starts=sum(len(r.cold_started) for r in results), decisions=len(scaler.events),
                       intervals=intervals)


def _p90(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.percentile(present, 90)) if present else None
