"""The canary's verbs: shift the weights, hold and judge a step, conclude (promote or roll back). The one
loop over the steps, with the rollback on any exception, is the canary_release flow's.

During a hold the judge (engine/canary/judge.py) looks every `check_interval_s` at the step's per-request
samples of both groups, so a failing canary is rolled back as soon as the evidence is clear, at the first
step that fails. The step ends with the Great Expectations suite run on the judge table: the declared gate.
Only the two groups' weights are touched; a group leaving traffic is drained before it is parked or removed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Literal, Protocol

from opentelemetry.trace import Status, StatusCode
from pydantic import BaseModel, Field

from engine.canary.gates import GateResult, GateSuite, step_row
from engine.canary.judge import ErrorCounts, MetricVerdict, Samples, SequentialJudge, step_verdict
from engine.canary.metrics import GroupFigures, MetricsSource
from engine.canary.plan import CanaryPlan, CanaryStep
from engine.canary.samples import RouterSamples
from engine.runtime.errors import TideflowError
from engine.router.admin import wait_drained
from engine.router.samples import Sample
from engine.telemetry import tracing

log = logging.getLogger(__name__)


class CanaryError(TideflowError):
    """The rollout cannot start (the groups are left at stable 100 %)."""


Decision = Literal["promoted", "rolled_back"]


class StepReport(BaseModel):
    index: int
    percent: float
    started_at: float = Field(description="unix time the weights were set")
    elapsed_s: float = Field(description="seconds from the weight change to the step's verdict")
    checks: int = Field(description="looks of the judge during the hold")
    canary: GroupFigures = Field(description="the canary's figures over the step (for people: the judge reads samples)")
    stable: GroupFigures
    baseline_step: int = Field(description="step whose stable samples the canary was judged against")
    verdicts: list[MetricVerdict] = Field(default_factory=list, description="the judge's last look, one row per metric")
    baseline_samples: list[Sample] = Field(default_factory=list, repr=False,
                                           description="the stable samples judged against (the next step may need them)")
    error_counts: ErrorCounts | None = Field(None, description="both sides' error counts at the last look, when "
                                                               "judged against this step's own stable samples: a "
                                                               "later step's error test carries them")
    passed: bool
    gate: GateResult | None = Field(None, description="the suite run on the judge table at the step's end")

    def failures(self) -> str:
        """Why the step failed, in words: the judge's metrics that did not pass, then the suite's failures."""
        bad = [f"{v.metric} {v.verdict} ({v.why}" + (f"; shift {v.estimate:+.1%}" if v.estimate is not None and v.metric != "errors" else "")
               + f"; {v.canary_n} canary / {v.baseline_n} baseline samples)" for v in self.verdicts if v.verdict != "pass"]
        return "; ".join(bad + (self.gate.failed if self.gate else [])) or "no verdict"


class CanaryReport(BaseModel):
    stable: str
    canary: str
    decision: Decision
    reason: str
    steps: list[StepReport] = Field(default_factory=list)
    weights: dict[str, float] = Field(default_factory=dict, description="router weights after the decision")
    suite: str = Field(description="name of the gate suite")
    aftermath: str = Field("", description="what could not be done after the decision (e.g. the stable group "
                                           "not parked yet because it still had open requests)")

    def table(self) -> list[dict]:
        """The judge table the suite ran on (one row per step and metric)."""
        return judge_table(self.steps)

    def figures(self) -> list[dict]:
        """Canary and stable figures per step (requests, error rate, p99s, throughput), for people."""
        return [step_row(s.index, s.percent, s.canary, s.stable, s.baseline_step) for s in self.steps]


def judge_table(steps: list[StepReport]) -> list[dict]:
    return [v.model_dump() for s in steps for v in s.verdicts]


class CanaryEvent(BaseModel):
    """What `progress` receives while the rollout runs."""

    kind: Literal["step_started", "checked", "step_passed", "promoted", "rolled_back"]
    step: int
    percent: float
    message: str = ""
    canary: GroupFigures | None = None
    stable: GroupFigures | None = None


Progress = Callable[[CanaryEvent], None]


class RouterVerbs(Protocol):
    """What the canary asks of the router: RouterAdmin, or the controller's client (which also stores weights)."""

    url: str

    def set_weights(self, weights: dict[str, float]) -> dict[str, float]: ...

    def groups(self) -> list[dict]: ...

    def inflight(self, name: str) -> int: ...


class FleetVerbs(Protocol):
    """What the canary asks of whoever runs the groups: a LocalGroupSet, or the controller's client."""

    def park(self, name: str, drain_s: float) -> float: ...

    def delete(self, name: str, drain_s: float) -> None: ...


Target = Any  # a FleetVerbs with an `admin` (LocalGroupSet), one that is both (ControlClient), or RouterVerbs only


def _verbs(target: Target) -> tuple[RouterVerbs, FleetVerbs | None]:
    admin = getattr(target, "admin", target)
    return admin, (target if hasattr(target, "park") and hasattr(target, "delete") else None)


def shift_weights(admin: RouterVerbs, stable: str, canary: str, percent: float) -> None:
    admin.set_weights({canary: percent, stable: 100.0 - percent})


def hold_step(stable: str, canary: str, index: int, step: CanaryStep, plan: CanaryPlan, source: MetricsSource,
              samples: RouterSamples, gates: GateSuite, done: list[StepReport], notify: Progress,
              trace_attributes: dict[str, str] | None = None) -> StepReport:
    """Judge the step (its weights already set) until every metric passes, one fails, or max_hold_s runs out;
    then run the suite on the judge table (the earlier steps' rows and this one's). The step is a `canary.step`
    span with the judge's verdict per metric (engine/telemetry/tracing.py); `trace_attributes` go on it too (the
    flow run that holds the step)."""
    span = tracing.tracer().start_span("canary.step", attributes={
        **(trace_attributes or {}), "canary.stable": stable, "canary.group": canary, "canary.step": index,
        "canary.percent": step.percent})
    try:
        report = _hold_step(stable, canary, index, step, plan, source, samples, gates, done, notify)
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    else:
        span.set_attributes({"canary.verdict": step_verdict(report.verdicts), "canary.checks": report.checks,
                             "canary.passed": report.passed, "canary.elapsed_s": report.elapsed_s,
                             **{f"canary.verdict.{v.metric}": v.verdict for v in report.verdicts}})
        return report
    finally:
        span.end()


def _hold_step(stable: str, canary: str, index: int, step: CanaryStep, plan: CanaryPlan, source: MetricsSource,
               samples: RouterSamples, gates: GateSuite, done: list[StepReport], notify: Progress) -> StepReport:
    started_at, t0 = time.time(), time.monotonic()
    notify(CanaryEvent(kind="step_started", step=index, percent=step.percent,
                       message=f"{canary} {step.percent:g} %, {stable} {100 - step.percent:g} %"))
    start = source.mark()
    samples.start()
    judge: SequentialJudge | None = None
    unsized = SequentialJudge(plan.judge, index)  # until the canary has min_samples: tests and spends nothing
    checks = 0
    while True:
        time.sleep(plan.check_interval_s)
        samples.fetch()
        elapsed = time.monotonic() - t0
        baseline, baseline_step = _baseline(samples.by_group.get(stable, []), index, plan, done)
        seen = samples.of(canary)
        if judge is None and len(seen) >= plan.judge.min_samples:  # the rate is known: so is the step's horizon
            judge = SequentialJudge(plan.judge, index, step_horizon(len(seen), elapsed, step))
        judged = Samples.of(baseline)
        verdicts = (judge or unsized).look(seen, judged, carried=_carried(done, baseline_step))
        if baseline_step != index:  # no concurrent baseline (100 %): the canary carries more load than the
            verdicts = [v for v in verdicts if v.metric == "errors"]  # stable did then; only errors compare
        checks += 1
        overall = step_verdict(verdicts)
        notify(CanaryEvent(kind="checked", step=index, percent=step.percent,
                           message=f"{overall}: " + ", ".join(f"{v.metric} {v.verdict}" for v in verdicts)))
        ended = (overall == "fail" or elapsed >= step.max_hold_s
                 or (overall == "pass" and (elapsed >= step.hold_s or all(v.clear for v in verdicts))))
        if not ended:
            continue
        figures = source.figures(start, source.mark(), [stable, canary])
        report = StepReport(index=index, percent=step.percent, started_at=started_at, elapsed_s=elapsed, checks=checks,
                            canary=figures[canary], stable=figures[stable], baseline_step=baseline_step,
                            verdicts=verdicts, baseline_samples=baseline, passed=False,
                            error_counts=ErrorCounts.of(seen, judged) if baseline_step == index else None)
        report.gate = gates.validate(judge_table([*done, report]))
        report.passed = report.gate.success
        return report


def step_horizon(canary_requests: int, elapsed_s: float, step: CanaryStep) -> int:
    """The canary requests the step's hold is expected to see, from the canary's arrival rate so far: the judge
    spends the step's alpha over them, so a busy step (a large share) spends it by its end, not over a fixed count
    it passes in seconds. Arrivals say nothing of how the canary behaves, so fixing the horizon on them keeps the
    judge's guarantee."""
    return math.ceil(canary_requests / max(elapsed_s, 1e-3) * step.hold_s)


def _carried(done: list[StepReport], baseline_step: int) -> list[ErrorCounts]:
    """The earlier steps' error counts for this step's error test: every step judged against its own stable
    samples, but the one whose samples this step borrows (counted once, here)."""
    return [s.error_counts for s in done if s.error_counts is not None and s.index != baseline_step]


def _baseline(stable: list[Sample], index: int, plan: CanaryPlan, done: list[StepReport]) -> tuple[list[Sample], int]:
    """The stable samples of this step, or (when it got too few, as at 100 %) those of the latest step that had
    them. Latency is judged only against a concurrent baseline: at 100 % the canary serves the load both groups
    shared before, so its latency against an earlier baseline would measure the load, not the version."""
    if len(stable) >= plan.judge.min_samples or not done:
        return stable, index
    last = done[-1]
    return last.baseline_samples, last.baseline_step


def conclude(target: Target, admin: RouterVerbs, stable: str, canary: str, plan: CanaryPlan, steps: list[StepReport],
            decision: Decision, reason: str, gates: GateSuite, notify: Progress) -> CanaryReport:
    promoted = decision == "promoted"
    aftermath = ""
    shift_weights(admin, stable, canary, 100.0 if promoted else 0.0)
    leaving = stable if promoted else canary
    wait_drained(admin, leaving, time.monotonic() + plan.drain_s)
    action = plan.on_promote if promoted else plan.on_rollback
    _, fleet = _verbs(target)
    if action == "remove":
        if fleet is not None:
            fleet.delete(leaving, plan.drain_s)
        else:
            admin.deregister(leaving)  # only a router: take it out of routing
    elif action == "park" and fleet is not None:
        try:
            fleet.park(leaving, plan.drain_s)  # to the warm pool: loaded, KV released, not routed
        except TideflowError as exc:
            # Parking never cuts a request off: a backlog longer than drain_s keeps the group Ready at
            # weight 0 (no new traffic) until it is parked later. The decision itself stands.
            aftermath = f"{leaving} stays Ready at weight 0, not parked yet: {exc}"
            log.warning("canary %s over %s: %s", canary, stable, aftermath)
    last = steps[-1]
    notify(CanaryEvent(kind=decision, step=last.index, percent=last.percent, message=reason))
    log.info("canary %s over %s: %s (%s)", canary, stable, decision, reason)
    weights = {g["name"]: g["weight"] for g in admin.groups()}
    return CanaryReport(stable=stable, canary=canary, decision=decision, reason=reason, steps=steps, weights=weights,
                        suite=gates.name, aftermath=aftermath)
