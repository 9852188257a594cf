"""Scaling policies as data, and the pure decision logic: metric watermarks, schedule, bounds.

The metric policy moves one way at a time with hysteresis (a high and a low watermark, and a
run of calm readings before going down) and cooldowns; the schedule names target counts by time
of day in a timezone and may lower the floor at night (KEDA's cron scaler cannot go below
minReplicaCount). The larger target wins, then the bounds (with the schedule's floor) clamp it.
"""

from __future__ import annotations

import math
from datetime import datetime, time
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def iana_zone(value: str) -> str:
    """A time zone name ZoneInfo knows, else a clear error (a schedule or a forecast in no zone is meaningless)."""
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"{value!r} is not an IANA timezone (e.g. 'UTC', 'America/New_York')") from None
    return value


class Bounds(BaseModel):
    """How few and how many serving groups the set may have."""

    model_config = ConfigDict(extra="forbid")

    min_groups: int = Field(1, ge=0, description="never fewer serving groups (a schedule entry's floor may lower it)")
    max_groups: int = Field(4, ge=1, description="never more serving groups")

    @model_validator(mode="after")
    def _ordered(self) -> "Bounds":
        if self.min_groups > self.max_groups:
            raise ValueError(f"min_groups {self.min_groups} is above max_groups {self.max_groups}")
        return self


class ScheduleEntry(BaseModel):
    """From `at` (local time of day) until the next entry, aim for `groups` serving groups."""

    model_config = ConfigDict(extra="forbid")

    at: time = Field(description="local time of day this entry starts, e.g. '07:30'")
    groups: int = Field(ge=0, description="target serving groups from `at` on")
    floor: int | None = Field(None, ge=0, description="replaces bounds.min_groups from `at` on (e.g. 0 at night)")


class Schedule(BaseModel):
    """Times of day to target counts; the last entry of the day carries over past midnight."""

    model_config = ConfigDict(extra="forbid")

    timezone: str = Field("UTC", description="IANA zone the entries' times are in, e.g. 'Europe/Paris'")
    entries: list[ScheduleEntry] = Field(min_length=1, description="entries; sorted by time on load")

    _zone = field_validator("timezone")(lambda value: iana_zone(value))

    @field_validator("entries")
    @classmethod
    def _sorted(cls, value: list[ScheduleEntry]) -> list[ScheduleEntry]:
        value = sorted(value, key=lambda e: e.at)
        times = [e.at for e in value]
        if len(set(times)) != len(times):
            raise ValueError("two schedule entries start at the same time")
        return value

    def active(self, now: datetime) -> ScheduleEntry:
        """The entry in force at `now` (an aware datetime, converted to the schedule's zone)."""
        if now.tzinfo is None:
            raise ValueError("the schedule needs an aware datetime (with a tzinfo)")
        local = now.astimezone(ZoneInfo(self.timezone)).time()
        current = self.entries[-1]  # before the first entry of the day, yesterday's last one holds
        for entry in self.entries:
            if entry.at <= local:
                current = entry
        return current


class MetricPolicy(BaseModel):
    """Watermarks per serving group: above any high one scale up, below every low one (for a while) scale down."""

    model_config = ConfigDict(extra="forbid")

    queue_high: float = Field(4.0, gt=0, description="waiting requests per serving group above which to scale up")
    queue_low: float = Field(0.5, ge=0, description="waiting requests per serving group below which down is allowed")
    running_high: float | None = Field(None, gt=0, description="running sequences per serving group above which to scale up")
    running_low: float | None = Field(None, ge=0, description="running sequences per serving group below which down is allowed")
    ttft_p99_high_ms: float | None = Field(None, gt=0, description="TTFT p99 (ms) above which to scale up")
    ttft_p99_low_ms: float | None = Field(None, ge=0, description="TTFT p99 (ms) below which down is allowed")
    step_up: int = Field(1, ge=1, description="most groups added per decision")
    step_down: int = Field(1, ge=1, description="most groups removed per decision")
    calm_ticks: int = Field(3, ge=1, description="consecutive calm readings before a scale down")
    cooldown_up_s: float = Field(5.0, ge=0, description="seconds after any change before scaling up again")
    cooldown_down_s: float = Field(30.0, ge=0, description="seconds after any change before scaling down")

    @model_validator(mode="after")
    def _bands(self) -> "MetricPolicy":
        for name, low, high in (("queue", self.queue_low, self.queue_high), ("running", self.running_low, self.running_high),
                                ("ttft_p99", self.ttft_p99_low_ms, self.ttft_p99_high_ms)):
            if (low is None) != (high is None):
                raise ValueError(f"{name}: give both the low and the high watermark, or neither")
            if low is not None and low >= high:
                raise ValueError(f"{name}: the low watermark {low:g} must be below the high one {high:g} (hysteresis)")
        return self


class ScalingPolicy(BaseModel):
    """Everything the autoscaler needs to decide; either part (metrics, schedule) may be absent."""

    model_config = ConfigDict(extra="forbid")

    bounds: Bounds = Field(default_factory=Bounds)
    warm_pool: int = Field(1, ge=0, description="standby groups kept loaded and warm for fast scale up")
    metrics: MetricPolicy | None = Field(None, description="metric-driven targets; None = schedule only")
    schedule: Schedule | None = Field(None, description="time-of-day targets; None = metrics only")
    tick_s: float = Field(2.0, gt=0, description="seconds between two decisions")


class Observation(BaseModel):
    """What the serving groups look like right now (summed over the serving groups)."""

    queued: int = Field(0, ge=0, description="requests waiting for admission in the engines")
    running: int = Field(0, ge=0, description="sequences in the engines' running batches")
    ttft_p99_ms: float | None = Field(None, ge=0, description="TTFT p99 over the last window; None = no requests")


class MetricScaler:
    """Metric-driven target with hysteresis and cooldowns; keeps the memory those need between ticks."""

    def __init__(self, policy: MetricPolicy) -> None:
        self.policy = policy
        self.last_change_at = -math.inf
        self.calm = 0

    def desired(self, current: int, obs: Observation, now_s: float) -> tuple[int, str]:
        """(target, why) for `current` serving groups at monotonic time `now_s`."""
        p, per = self.policy, max(current, 1)
        hot = _hot(p, obs, per)
        if hot:
            self.calm = 0
            if now_s - self.last_change_at < p.cooldown_up_s:
                return current, f"{hot}; cooling down"
            return current + p.step_up, hot
        if not _calm(p, obs, per):
            self.calm = 0
            return current, "within the watermarks"
        self.calm += 1
        if self.calm < p.calm_ticks:
            return current, f"calm {self.calm}/{p.calm_ticks}"
        if now_s - self.last_change_at < p.cooldown_down_s:
            return current, "calm; cooling down"
        return max(0, current - p.step_down), "calm"

    def changed(self, now_s: float) -> None:
        """The serving count changed (for whatever reason): restart the cooldowns and the calm run."""
        self.last_change_at, self.calm = now_s, 0


def _hot(p: MetricPolicy, obs: Observation, per: int) -> str:
    if obs.queued / per > p.queue_high:
        return f"queue {obs.queued / per:.1f}/group > {p.queue_high:g}"
    if p.running_high is not None and obs.running / per > p.running_high:
        return f"running {obs.running / per:.1f}/group > {p.running_high:g}"
    if p.ttft_p99_high_ms is not None and obs.ttft_p99_ms is not None and obs.ttft_p99_ms > p.ttft_p99_high_ms:
        return f"TTFT p99 {obs.ttft_p99_ms:.0f} ms > {p.ttft_p99_high_ms:g}"
    return ""


def _calm(p: MetricPolicy, obs: Observation, per: int) -> bool:
    if obs.queued / per > p.queue_low:
        return False
    if p.running_low is not None and obs.running / per > p.running_low:
        return False
    return p.ttft_p99_low_ms is None or obs.ttft_p99_ms is None or obs.ttft_p99_ms <= p.ttft_p99_low_ms


class Decision(BaseModel):
    """One tick's decision, as logged."""

    at: datetime = Field(description="wall time of the decision (aware)")
    current: int = Field(ge=0, description="serving groups (and cold starts on their way) before the decision")
    metric_target: int | None = Field(None, description="what the metric policy asked for")
    schedule_target: int | None = Field(None, description="what the schedule asked for")
    floor: int = Field(ge=0, description="lower bound in force (bounds.min_groups or the schedule's floor)")
    target: int = Field(ge=0, description="the decision: max of both targets, clamped to [floor, max_groups]")
    reason: str = Field("", description="why, in words")


def combine(policy: ScalingPolicy, current: int, metric: tuple[int, str] | None, now: datetime) -> Decision:
    """The larger of the metric and schedule targets, clamped to the bounds (with the schedule's floor)."""
    entry = policy.schedule.active(now) if policy.schedule is not None else None
    floor = policy.bounds.min_groups if entry is None or entry.floor is None else min(entry.floor, policy.bounds.max_groups)
    wanted = [t for t in (metric[0] if metric else None, entry.groups if entry else None) if t is not None]
    raw = max(wanted) if wanted else current
    target = min(max(raw, floor), policy.bounds.max_groups)
    reasons = []
    if metric is not None:
        reasons.append(f"metrics: {metric[1]} -> {metric[0]}")
    if entry is not None:
        reasons.append(f"schedule {entry.at:%H:%M} {policy.schedule.timezone} -> {entry.groups}")
    if target != raw:
        reasons.append(f"clamped to [{floor}, {policy.bounds.max_groups}]")
    return Decision(at=now, current=current, metric_target=metric[0] if metric else None,
                    schedule_target=entry.groups if entry else None, floor=floor, target=target, reason="; ".join(reasons))
