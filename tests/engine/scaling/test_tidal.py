"""The tidal day: its phases and trace (fast), and a short replay under the autoscaler (slow)."""

from __future__ import annotations

import json

import pytest

from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds, MetricPolicy, ScalingPolicy
from harness.tidal_replay import replay_day
from harness.tide import CompressedClock, TidalDay


def test_the_day_has_its_phases_and_rates():
    day = TidalDay(day_s=240, night_rps=1, peak_rps=9)
    assert [day.phase(h) for h in (3, 8, 12, 19, 23)] == ["night", "ramp", "peak", "fall", "night"]
    assert day.rate(8.5) == pytest.approx(5.0)  # halfway up the ramp
    assert day.rate(19.5) == pytest.approx(5.0)  # halfway down the fall
    assert day.hour_at(60) == pytest.approx(6.0)
    assert CompressedClock(day, 100.0)(160.0).hour == 6


def test_the_trace_is_denser_at_the_peak(tmp_path):
    day = TidalDay(day_s=240, night_rps=0.5, peak_rps=8)
    n = day.write_trace(tmp_path / "t.jsonl", seed=3)
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert len(lines) == n and all(x["max_tokens"] == day.max_tokens for x in lines)
    night = sum(day.phase(day.hour_at(x["arrival_s"])) == "night" for x in lines) / (9 / 24 * 240)
    peak = sum(day.phase(day.hour_at(x["arrival_s"])) == "peak" for x in lines) / (7 / 24 * 240)
    assert peak > 5 * night


def test_an_unforecast_burst_multiplies_the_tide_while_it_lasts(tmp_path):
    day = TidalDay(day_s=240, night_rps=0.5, peak_rps=4, spike_start_h=13.0, spike_hours=1.2, spike_factor=3.0)
    assert day.rate(13.5) == pytest.approx(12.0) and day.tide(13.5) == pytest.approx(4.0)
    assert day.rate(14.3) == pytest.approx(4.0) and day.rate(12.9) == pytest.approx(4.0)
    day.write_trace(tmp_path / "t.jsonl", seed=1)
    hours = [day.hour_at(json.loads(x)["arrival_s"]) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    in_burst = sum(13.0 <= h < 14.2 for h in hours) / 1.2
    around = sum(10.0 <= h < 13.0 or 14.2 <= h < 17.0 for h in hours) / 5.8
    assert in_burst > 2 * around  # 3x the peak's density, give or take Poisson noise


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_short_tidal_day_follows_the_schedule_and_loses_nothing(groupset, tiny_model_dir, tmp_path):
    day = TidalDay(day_s=48, night_rps=0.5, peak_rps=4, max_tokens=16)
    trace = tmp_path / "tidal.jsonl"
    day.write_trace(trace)
    template = InferenceGroup.model_validate({
        "name": "day", "version": "v1", "model": {"path": str(tiny_model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 4_000_000, "max_num_seqs": 4}}]})
    policy = ScalingPolicy(bounds=Bounds(min_groups=1, max_groups=3), warm_pool=1, tick_s=0.5,
                           metrics=MetricPolicy(queue_high=2, queue_low=0.5, cooldown_up_s=2, cooldown_down_s=4),
                           schedule=day.schedule(night=1, ramp=2, peak=2, fall=1, night_floor=1))
    report = replay_day(groupset, template, policy, day, trace)
    assert report.errors == 0 and report.ok == report.sent
    by = {p.phase: p for p in report.phases}
    assert by["night"].groups_max >= 1
    assert by["peak"].groups_max >= 2  # the schedule's peak target was served
    assert report.activations_s  # the ramp came from the warm pool
