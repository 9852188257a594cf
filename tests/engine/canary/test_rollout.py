"""run_canary against a real group set under load: promote a healthy canary, roll back faulty ones,
lose no request, and read the same step figures from Prometheus as from a direct scrape."""

from __future__ import annotations

import json
import math
import time

import pytest

from engine.canary import CanaryPlan, DirectSource, PrometheusSource, run_canary
from engine.canary.plan import DEFAULT_SUITE
from engine.canary.rollout import CanaryError
from engine.faults import INJECTED_CODE
from engine.group.manager import GroupState

FIGURES = ("requests", "errors", "error_rate", "ttft_p99_s", "tpot_p99_s", "throughput_tps", "window_s")
EXCESS_MS = {"ttft_p99_excess_ms": 1000.0, "tpot_p99_excess_ms": 150.0}


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """The repo's suite with its latency ratios replaced by absolute excesses: a p99 over the handful of
    requests a short hold sees is close to their maximum, and on a shared 2-core machine a healthy canary's
    maximum reaches several times the stable's p99 of a few milliseconds; the slow fault adds 300 ms an output."""
    data = json.loads(DEFAULT_SUITE.read_text())
    data["expectations"] = [e for e in data["expectations"] if not e["kwargs"].get("column", "").endswith("_p99_ratio")]
    data["expectations"] += [{"type": "expect_column_values_to_be_between", "kwargs": {"column": c, "max_value": v}}
                             for c, v in EXCESS_MS.items()]
    path = tmp_path_factory.mktemp("suite") / "canary.json"
    path.write_text(json.dumps(data))
    return path


def plan(suite, hold_s: float, *percents: float) -> CanaryPlan:
    return CanaryPlan(steps=[{"percent": p, "hold_s": hold_s, "min_requests": 5, "max_hold_s": 30} for p in percents],
                      check_interval_s=1.0, drain_s=5.0, suite=suite)


def assert_nothing_lost(load) -> None:
    assert load.ok > 0 and load.sent == load.ok + load.error
    assert all(INJECTED_CODE in m or "injected fault" in m for m in load.messages), load.messages[:3]


def test_prometheus_and_direct_scrape_give_the_same_step_figures(fleet, load):
    fleet.only(stable=60, bad=40)  # the faulty group makes error rates non-zero on one side
    direct, prom = DirectSource.for_groupset(fleet.gs), PrometheusSource(fleet.prometheus.url)
    try:
        time.sleep(2.5)  # quiet, so Prometheus's latest samples are what a scrape sees now
        start = direct.mark()
        with load(limit=120) as traffic:
            traffic.wait()
        time.sleep(2.5)
        end = direct.mark()
        groups = ["stable", "bad"]
        ours = direct.figures(start, end, groups)
        # Prometheus ingests on its own scrape clock: poll until a scrape after `end` has landed (bounded).
        deadline = time.monotonic() + 20
        while True:
            theirs = prom.figures(start, end, groups)
            if not _differences(ours, theirs, groups) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        direct.close()
    assert_nothing_lost(traffic)
    assert ours["bad"].errors > 0 and ours["stable"].ttft_p99_s is not None
    assert sum(f.requests for f in ours.values()) >= traffic.sent
    assert _differences(ours, theirs, groups) == []


def _differences(ours, theirs, groups) -> list:
    out = []
    for g in groups:
        if g not in theirs or ours[g].version != theirs[g].version:
            out.append((g, "version"))
            continue
        for name in FIGURES:
            a, b = getattr(ours[g], name), getattr(theirs[g], name)
            if not ((a is None and b is None) or (a is not None and b is not None
                                                 and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9))):
                out.append((g, name, a, b))
    return out


def test_failing_canary_is_rolled_back_at_the_first_step_within_its_hold(fleet, load, suite):
    fleet.only(stable=100)
    the_plan = plan(suite, 15.0, 5, 25, 50, 100)
    with load() as traffic:
        report = run_canary(fleet.gs, "stable", "bad", the_plan, PrometheusSource(fleet.prometheus.url))
    assert report.decision == "rolled_back" and len(report.steps) == 1
    step = report.steps[0]
    assert not step.passed and step.checks == 1 and step.elapsed_s <= the_plan.steps[0].hold_s
    assert any("error_rate_excess_pp" in f for f in step.gate.failed), step.gate.failed
    assert step.canary.error_rate > 0.005 and "error_rate_excess_pp" in report.reason
    assert report.weights["bad"] == 0 and report.weights["stable"] == 100  # canary kept for inspection
    assert_nothing_lost(traffic)


def test_slow_canary_is_rolled_back_on_latency_and_removed(fleet, load, suite):
    fleet.only(stable=100)
    the_plan = plan(suite, 15.0, 5, 25, 50, 100).model_copy(update={"on_rollback": "remove"})
    source = DirectSource.for_groupset(fleet.gs)
    try:
        with load() as traffic:
            report = run_canary(fleet.gs, "stable", "slow", the_plan, source)
    finally:
        source.close()
    assert report.decision == "rolled_back" and len(report.steps) == 1, report.reason
    step = report.steps[0]
    assert step.checks == 1 and step.elapsed_s <= the_plan.steps[0].hold_s
    assert any("p99_excess_ms" in f for f in step.gate.failed), step.gate.failed
    assert step.canary.error_rate == 0
    assert "slow" not in report.weights and report.weights["stable"] == 100
    assert fleet.gs.manager.groups["slow"].status.state == GroupState.STOPPED
    assert_nothing_lost(traffic)
    assert traffic.error == 0


def test_a_step_without_enough_canary_traffic_rolls_back_through_the_router_alone(fleet, suite):
    fleet.only(stable=100)
    quiet = CanaryPlan(steps=[{"percent": 100, "hold_s": 1, "min_requests": 5, "max_hold_s": 2}], suite=suite)
    source = DirectSource(fleet.gs.url, fleet.gs.client_key)  # router only: no engine endpoints scraped
    try:
        report = run_canary(fleet.gs.admin, "stable", "good", quiet, source)
    finally:
        source.close()
    assert report.decision == "rolled_back" and "only 0 canary requests" in report.reason
    assert report.steps[0].gate is None and report.weights["good"] == 0 and report.weights["stable"] == 100


def test_unregistered_groups_are_refused_before_any_weight_changes(fleet, suite):
    fleet.only(stable=100)
    with pytest.raises(CanaryError, match="nope"):
        run_canary(fleet.gs.admin, "stable", "nope", CanaryPlan(suite=suite), DirectSource(fleet.gs.url, "unused"))
    assert {g["name"]: g["weight"] for g in fleet.gs.admin.groups()}["stable"] == 100


def test_healthy_canary_is_promoted_through_every_step(fleet, load, suite):
    fleet.only(stable=100)
    events = []
    source = DirectSource.for_groupset(fleet.gs)
    try:
        with load() as traffic:
            report = run_canary(fleet.gs, "stable", "good", plan(suite, 3.0, 5, 25, 50, 100), source, progress=events.append)
    finally:
        source.close()
    assert report.decision == "promoted", (report.reason, json.dumps(report.table()[-1]))
    assert [s.percent for s in report.steps] == [5, 25, 50, 100] and all(s.passed for s in report.steps)
    assert all(s.canary.requests >= 5 and s.gate.success for s in report.steps)
    assert report.steps[-1].baseline_step == 2  # no stable traffic at 100 %: judged against the 50 % step
    assert report.weights["good"] == 100 and "stable" not in report.weights
    stable = fleet.gs.manager.groups["stable"]
    assert stable.status.state == GroupState.STANDBY  # parked in the warm pool
    stable.activate()  # serving again for whatever runs next
    assert [e.kind for e in events if e.kind != "checked"] == ["step_started", "step_passed"] * 4 + ["promoted"]
    assert len(report.table()) == 4 and report.steps[0].gate.validation["success"] is True
    assert_nothing_lost(traffic)
    assert traffic.error == 0
