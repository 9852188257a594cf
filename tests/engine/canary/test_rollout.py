"""The canary's verbs against a real group set under load: hold_step judges a faulty canary failed and a
quiet one inconclusive, a healthy one passes (latency judged only against a concurrent baseline) and
conclude parks the stable group; no request is lost; Prometheus and a direct scrape give the same step
figures. The loop over the steps is the canary_release flow's (tests/flows/test_canary_release.py)."""

from __future__ import annotations

import math
import time

import pytest


from engine.canary import CanaryPlan, CanaryStep, DirectSource, PrometheusSource
from engine.canary.gates import GateSuite
from engine.canary.judge import ErrorCounts, JudgeConfig
from engine.canary.rollout import StepReport, _carried, conclude, hold_step, shift_weights, step_horizon
from engine.canary.samples import RouterSamples
from engine.server.faults import INJECTED_CODE
from engine.group.manager import GroupState
from harness.canary import SHARED_CORES_JUDGE

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

FIGURES = ("requests", "errors", "error_rate", "ttft_p99_s", "tpot_p99_s", "throughput_tps", "window_s")


def plan(hold_s: float, *percents: float, max_hold_s: float = 90,
         judge: JudgeConfig = JudgeConfig(horizon=30)) -> CanaryPlan:
    """The shipped judge's margins and suite; the horizon of 30 canary requests fits a test's few seconds
    per step."""
    return CanaryPlan(steps=[{"percent": p, "hold_s": hold_s, "max_hold_s": max_hold_s} for p in percents],
                      judge=judge, check_interval_s=1.0, drain_s=5.0)


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


def hold(fleet, canary: str, the_plan: CanaryPlan, source, index: int = 0, done=(), events=None):
    """Set the step's weights and hold it with the judge; the weights are left as the step set them."""
    step = the_plan.steps[index]
    shift_weights(fleet.gs.admin, "stable", canary, step.percent)
    samples = RouterSamples(fleet.gs.url, fleet.gs.client_key, ["stable", canary])
    try:
        return hold_step("stable", canary, index, step, the_plan, source, samples, GateSuite(the_plan.suite_path()),
                         list(done), events.append if events is not None else (lambda e: None))
    finally:
        samples.close()


def test_an_erroring_canary_fails_its_step_on_errors(fleet, load):
    fleet.only(stable=100)
    try:
        with load() as traffic:
            step = hold(fleet, "bad", plan(15.0, 5, 100), PrometheusSource(fleet.prometheus.url))
    finally:
        fleet.only(stable=100)
    assert not step.passed and verdicts(step)["errors"] == "fail", step.verdicts
    errors = next(v for v in step.verdicts if v.metric == "errors")
    assert errors.p_value <= errors.alpha_look and errors.estimate > 0.1  # the fault fails half its requests
    assert any("verdict" in f for f in step.gate.failed) and "errors fail" in step.failures()
    assert step.canary.error_rate > 0.1
    assert_nothing_lost(traffic)


def test_a_slow_canary_fails_its_step_on_latency(fleet, load):
    fleet.only(stable=100)
    source = DirectSource.for_groupset(fleet.gs)
    try:
        with load() as traffic:
            step = hold(fleet, "slow", plan(15.0, 5, 100), source)
    finally:
        fleet.only(stable=100)
        source.close()
    failed = {m for m, v in verdicts(step).items() if v == "fail"}
    assert not step.passed and failed & {"ttft", "tpot", "e2e"} and "errors" not in failed, step.verdicts
    # every failed metric reports a lower bound clear of its margin, under its estimate (the bound comes from a
    # search over pairwise differences, the verdict from counts: they must agree)
    fails = [v for v in step.verdicts if v.verdict == "fail"]
    assert all(v.margin < v.ci_low <= v.estimate for v in fails), [
        (v.metric, v.canary_n, v.baseline_n, v.estimate, v.ci_low, v.margin) for v in fails]
    # the canary's own figures show the injected 300 ms before every output: no canary token came sooner (how
    # many times the baseline that is depends on how busy the shared cores were, so no ratio is asserted)
    assert step.canary.ttft_p99_s >= 0.3, step.canary
    assert step.canary.error_rate == 0
    assert_nothing_lost(traffic)
    assert traffic.error == 0


def test_a_step_without_canary_traffic_is_inconclusive_and_fails_its_gate(fleet):
    fleet.only(stable=100)
    source = DirectSource(fleet.gs.url, fleet.gs.client_key)  # router only: no engine endpoints scraped
    try:
        step = hold(fleet, "good", plan(1, 100, max_hold_s=2), source)
    finally:
        fleet.only(stable=100)
        source.close()
    assert set(verdicts(step).values()) == {"inconclusive"} and step.elapsed_s >= 2
    assert not step.passed and not step.gate.success and "inconclusive" in step.failures()


def test_a_healthy_canary_passes_and_is_promoted(fleet, load):
    """The first step splits the load evenly, so both groups see the same batching and contention; the
    judge is the one for shared cores (harness/canary.py)."""
    fleet.only(stable=100)
    the_plan = plan(3.0, 50, 100, judge=SHARED_CORES_JUDGE)
    events: list = []
    source = DirectSource.for_groupset(fleet.gs)
    try:
        with load() as traffic:
            first = hold(fleet, "good", the_plan, source, events=events)
            assert first.passed, first.failures()
            last = hold(fleet, "good", the_plan, source, index=1, done=[first], events=events)
            assert last.passed, last.failures()
            report = conclude(fleet.gs, fleet.gs.admin, "stable", "good", the_plan, [first, last], "promoted",
                              "every step passed", GateSuite(the_plan.suite_path()), events.append)
    finally:
        source.close()
    assert set(verdicts(first).values()) == {"pass"} and all(v.canary_n >= 20 and v.p_value is not None
                                                             for v in first.verdicts)
    assert last.baseline_step == 0  # no stable traffic at 100 %: errors judged against the 50 % step
    assert [v.metric for v in last.verdicts] == ["errors"]  # latency only against a concurrent baseline
    assert first.error_counts.canary_n >= 20 and last.error_counts is None  # 100 %: its baseline is borrowed
    assert last.verdicts[0].carried_steps == 0  # so step 0's counts are not carried (its baseline counted once)
    assert report.decision == "promoted" and report.weights["good"] == 100 and "stable" not in report.weights
    stable = fleet.gs.manager.groups["stable"]
    assert stable.status.state == GroupState.STANDBY  # parked in the warm pool
    stable.activate()  # serving again for whatever runs next
    assert [e.kind for e in events if e.kind != "checked"] == ["step_started", "step_started", "promoted"]
    assert len(report.table()) == 5 and report.steps[0].gate.validation["success"] is True
    assert_nothing_lost(traffic)
    assert traffic.error == 0


def test_a_step_s_horizon_is_its_hold_at_the_canary_s_arrival_rate():
    assert step_horizon(30, 3.0, CanaryStep(percent=5, hold_s=60)) == 600
    assert step_horizon(20, 0.0, CanaryStep(percent=50, hold_s=1)) >= 20  # a burst at once: bounded, not a division by 0


def test_a_step_carries_the_earlier_steps_error_counts_but_never_a_borrowed_baseline_s():
    """Steps 0 and 1 were judged against their own stable samples, step 2 had no concurrent baseline (none
    recorded): step 3 judged against its own carries 0 and 1; a 100 % step borrowing step 1's baseline carries 0."""
    def report(index: int, errors: int | None) -> StepReport:
        counts = None if errors is None else ErrorCounts(canary_errors=errors, canary_n=100, baseline_errors=0,
                                                         baseline_n=900)
        return StepReport.model_construct(index=index, error_counts=counts)

    done = [report(0, 1), report(1, 2), report(2, None)]
    assert [c.canary_errors for c in _carried(done, baseline_step=3)] == [1, 2]
    assert [c.canary_errors for c in _carried(done, baseline_step=1)] == [1]
