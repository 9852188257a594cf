"""run_canary against a real group set under load: promote a healthy canary, roll back faulty ones,
lose no request, and read the same step figures from Prometheus as from a direct scrape."""

from __future__ import annotations

import json
import math
import time

import pytest

from engine.canary import CanaryPlan, DirectSource, PrometheusSource, run_canary
from engine.canary.judge import JudgeConfig
from engine.canary.rollout import CanaryError
from engine.faults import INJECTED_CODE
from engine.group.manager import GroupState

FIGURES = ("requests", "errors", "error_rate", "ttft_p99_s", "tpot_p99_s", "throughput_tps", "window_s")


def plan(hold_s: float, *percents: float, max_hold_s: float = 90) -> CanaryPlan:
    """The shipped judge and suite; the horizon of 30 canary requests fits a test's few seconds per step."""
    return CanaryPlan(steps=[{"percent": p, "hold_s": hold_s, "max_hold_s": max_hold_s} for p in percents],
                      judge=JudgeConfig(horizon=30), check_interval_s=1.0, drain_s=5.0)


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


def verdicts(step) -> dict[str, str]:
    return {v.metric: v.verdict for v in step.verdicts}


def test_failing_canary_is_rolled_back_at_the_first_step_on_its_errors(fleet, load):
    fleet.only(stable=100)
    the_plan = plan(15.0, 5, 25, 50, 100)
    with load() as traffic:
        report = run_canary(fleet.gs, "stable", "bad", the_plan, PrometheusSource(fleet.prometheus.url), fleet.gs.client_key)
    assert report.decision == "rolled_back" and len(report.steps) == 1, report.reason
    step = report.steps[0]
    assert not step.passed and verdicts(step)["errors"] == "fail", step.verdicts
    errors = next(v for v in step.verdicts if v.metric == "errors")
    assert errors.p_value <= errors.alpha_look and errors.estimate > 0.1  # the fault fails half its requests
    assert any("verdict" in f for f in step.gate.failed) and "errors fail" in report.reason
    assert step.canary.error_rate > 0.1
    assert report.weights["bad"] == 0 and report.weights["stable"] == 100  # canary kept for inspection
    assert_nothing_lost(traffic)


def test_slow_canary_is_rolled_back_on_latency_and_removed(fleet, load):
    fleet.only(stable=100)
    the_plan = plan(15.0, 5, 25, 50, 100).model_copy(update={"on_rollback": "remove"})
    source = DirectSource.for_groupset(fleet.gs)
    try:
        with load() as traffic:
            report = run_canary(fleet.gs, "stable", "slow", the_plan, source, fleet.gs.client_key)
    finally:
        source.close()
    assert report.decision == "rolled_back" and len(report.steps) == 1, report.reason
    step = report.steps[0]
    failed = {m for m, v in verdicts(step).items() if v == "fail"}
    assert failed & {"tpot", "e2e"} and "errors" not in failed, step.verdicts
    tpot = next(v for v in step.verdicts if v.metric == "tpot")
    assert tpot.ci_low > 1.0  # 300 ms an output against a few ms: far more than twice as slow
    assert step.canary.error_rate == 0
    assert "slow" not in report.weights and report.weights["stable"] == 100
    assert fleet.gs.manager.groups["slow"].status.state == GroupState.STOPPED
    assert_nothing_lost(traffic)
    assert traffic.error == 0


def test_a_step_without_canary_traffic_is_inconclusive_and_rolls_back(fleet):
    fleet.only(stable=100)
    quiet = plan(1, 100, max_hold_s=2)
    source = DirectSource(fleet.gs.url, fleet.gs.client_key)  # router only: no engine endpoints scraped
    try:
        report = run_canary(fleet.gs.admin, "stable", "good", quiet, source, fleet.gs.client_key)
    finally:
        source.close()
    assert report.decision == "rolled_back" and "inconclusive" in report.reason, report.reason
    assert set(verdicts(report.steps[0]).values()) == {"inconclusive"}
    assert not report.steps[0].gate.success and report.weights["good"] == 0 and report.weights["stable"] == 100


def test_unregistered_groups_are_refused_before_any_weight_changes(fleet):
    fleet.only(stable=100)
    with pytest.raises(CanaryError, match="nope"):
        run_canary(fleet.gs.admin, "stable", "nope", CanaryPlan(), DirectSource(fleet.gs.url, "unused"), "unused")
    assert {g["name"]: g["weight"] for g in fleet.gs.admin.groups()}["stable"] == 100


def test_healthy_canary_is_promoted_through_every_step(fleet, load):
    fleet.only(stable=100)
    events = []
    source = DirectSource.for_groupset(fleet.gs)
    try:
        with load() as traffic:
            report = run_canary(fleet.gs, "stable", "good", plan(3.0, 5, 25, 50, 100), source, fleet.gs.client_key,
                                progress=events.append)
    finally:
        source.close()
    assert report.decision == "promoted", (report.reason, json.dumps(report.table()[-4:], default=str))
    assert [s.percent for s in report.steps] == [5, 25, 50, 100] and all(s.passed for s in report.steps)
    assert all(set(verdicts(s).values()) == {"pass"} and s.gate.success for s in report.steps)
    assert all(v.canary_n >= 20 and v.p_value is not None for s in report.steps for v in s.verdicts)
    assert report.steps[-1].baseline_step == 2  # no stable traffic at 100 %: errors judged against the 50 % step
    assert [v.metric for v in report.steps[-1].verdicts] == ["errors"]  # latency only against a concurrent baseline
    assert report.weights["good"] == 100 and "stable" not in report.weights
    stable = fleet.gs.manager.groups["stable"]
    assert stable.status.state == GroupState.STANDBY  # parked in the warm pool
    stable.activate()  # serving again for whatever runs next
    assert [e.kind for e in events if e.kind != "checked"] == ["step_started", "step_passed"] * 4 + ["promoted"]
    assert len(report.table()) == 13 and report.steps[0].gate.validation["success"] is True
    assert_nothing_lost(traffic)
    assert traffic.error == 0
