"""Pure scaling logic: watermarks with hysteresis, cooldowns, the schedule in its timezone, max-of-both within bounds."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from pydantic import ValidationError

from engine.scaling.policy import (
    Bounds, MetricPolicy, MetricScaler, Observation, Schedule, ScalingPolicy, combine,
)
from engine.scaling.observe import bucket_quantile

UTC = timezone.utc
NOON = datetime(2024, 6, 3, 12, 0, tzinfo=UTC)


def scaler(**kw) -> MetricScaler:
    base = dict(queue_high=4, queue_low=1, calm_ticks=2, cooldown_up_s=10, cooldown_down_s=30)
    return MetricScaler(MetricPolicy(**{**base, **kw}))


def test_queue_above_high_watermark_scales_up_by_one_step():
    assert scaler().desired(2, Observation(queued=9), 100.0)[0] == 3
    assert scaler(step_up=2).desired(2, Observation(queued=9), 100.0)[0] == 4


def test_between_watermarks_holds_and_resets_the_calm_run():
    s = scaler()
    assert s.desired(2, Observation(queued=0), 100.0)[0] == 2  # calm 1/2
    assert s.desired(2, Observation(queued=5), 101.0)[0] == 2  # 2.5/group: inside the band
    assert s.desired(2, Observation(queued=0), 102.0)[0] == 2  # calm run restarted: 1/2 again
    assert s.desired(2, Observation(queued=0), 103.0)[0] == 1


def test_scale_up_waits_for_the_cooldown_after_a_change():
    s = scaler()
    s.changed(100.0)
    target, why = s.desired(2, Observation(queued=20), 105.0)
    assert target == 2 and "cooling" in why
    assert s.desired(2, Observation(queued=20), 111.0)[0] == 3


def test_scale_down_needs_calm_ticks_and_the_longer_cooldown():
    s = scaler()
    s.changed(100.0)
    for t in (101.0, 102.0, 120.0):
        assert s.desired(3, Observation(queued=0), t)[0] == 3
    assert s.desired(3, Observation(queued=0), 131.0)[0] == 2


def test_ttft_and_running_watermarks():
    s = scaler(ttft_p99_high_ms=500, ttft_p99_low_ms=100, running_high=8, running_low=2)
    assert s.desired(1, Observation(ttft_p99_ms=900), 100.0)[0] == 2
    assert s.desired(2, Observation(running=20), 200.0)[0] == 3
    calm = scaler(ttft_p99_high_ms=500, ttft_p99_low_ms=100, calm_ticks=1, cooldown_down_s=0)
    assert calm.desired(2, Observation(ttft_p99_ms=300), 100.0)[0] == 2  # above the low mark: no down
    assert calm.desired(2, Observation(ttft_p99_ms=50), 101.0)[0] == 1


def test_watermarks_must_leave_a_hysteresis_band():
    with pytest.raises(ValidationError, match="below the high"):
        MetricPolicy(queue_high=2, queue_low=2)
    with pytest.raises(ValidationError, match="both"):
        MetricPolicy(ttft_p99_high_ms=500)


def night_and_day(tz: str = "Europe/Paris") -> Schedule:
    return Schedule.model_validate({"timezone": tz, "entries": [
        {"at": "22:00", "groups": 0, "floor": 0}, {"at": "07:00", "groups": 2}, {"at": "10:00", "groups": 4}]})


def test_schedule_reads_local_time_and_wraps_past_midnight():
    s = night_and_day()
    # Paris is UTC+2 in June: 04:30 UTC is 06:30 there, still night (yesterday's 22:00 entry)
    assert s.active(datetime(2024, 6, 3, 4, 30, tzinfo=UTC)).groups == 0
    assert s.active(datetime(2024, 6, 3, 5, 30, tzinfo=UTC)).groups == 2  # 07:30 Paris
    assert s.active(datetime(2024, 6, 3, 8, 0, tzinfo=UTC)).groups == 4  # 10:00 Paris
    assert s.active(datetime(2024, 6, 3, 20, 30, tzinfo=UTC)).groups == 0  # 22:30 Paris
    # the same instant in a zone 9 hours further east is already the next morning there
    assert night_and_day("Asia/Tokyo").active(datetime(2024, 6, 3, 22, 30, tzinfo=UTC)).groups == 2


def test_schedule_validation():
    with pytest.raises(ValidationError, match="IANA"):
        Schedule.model_validate({"timezone": "Mars/Olympus", "entries": [{"at": "00:00", "groups": 1}]})
    with pytest.raises(ValidationError, match="same time"):
        Schedule.model_validate({"entries": [{"at": "08:00", "groups": 1}, {"at": "08:00", "groups": 2}]})
    with pytest.raises(ValueError, match="aware"):
        night_and_day().active(datetime(2024, 6, 3, 12, 0))
    with pytest.raises(ValidationError, match="above max_groups"):
        Bounds(min_groups=5, max_groups=2)


def test_the_larger_target_wins_within_the_bounds():
    policy = ScalingPolicy(bounds=Bounds(min_groups=1, max_groups=3), schedule=night_and_day("UTC"))
    assert combine(policy, 2, (1, "calm"), NOON).target == 3  # schedule 4, clamped to max 3
    morning = datetime(2024, 6, 3, 8, 0, tzinfo=UTC)
    d = combine(policy, 2, (3, "queue"), morning)
    assert (d.metric_target, d.schedule_target, d.target) == (3, 2, 3)
    assert combine(policy, 2, (1, "calm"), morning).target == 2


def test_a_night_floor_goes_below_min_groups():
    policy = ScalingPolicy(bounds=Bounds(min_groups=1, max_groups=3), schedule=night_and_day("UTC"))
    night = datetime(2024, 6, 3, 23, 0, tzinfo=UTC)
    d = combine(policy, 1, (0, "calm"), night)
    assert (d.floor, d.target) == (0, 0)
    assert combine(policy, 1, (2, "queue"), night).target == 2  # demand still wins at night
    day_without_floor = combine(policy, 1, None, datetime(2024, 6, 3, 8, 0, tzinfo=UTC))
    assert day_without_floor.floor == 1


def test_without_a_schedule_the_bounds_hold():
    policy = ScalingPolicy(bounds=Bounds(min_groups=2, max_groups=3))
    assert combine(policy, 2, (1, "calm"), NOON).target == 2
    assert combine(policy, 3, (4, "queue"), NOON).target == 3


def test_bucket_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1)
    assert bucket_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 0.9)
    assert bucket_quantile(0.99, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert bucket_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == pytest.approx(0.1)
