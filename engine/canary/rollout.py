"""The canary controller: shift traffic step by step, gate each hold, promote or roll back.

During a hold the gates run every `check_interval_s` once the canary has `min_requests` in the
step, so a failing canary is rolled back within one hold period, at the first step that fails.
Only the two groups' weights are touched; a group leaving traffic is drained before it is parked or removed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Literal, Protocol

from pydantic import BaseModel, Field

from engine.canary.gates import GateResult, GateSuite, step_row
from engine.canary.metrics import GroupFigures, MetricsSource
from engine.canary.plan import CanaryPlan, CanaryStep
from engine.errors import TideflowError

log = logging.getLogger(__name__)


class CanaryError(TideflowError):
    """The rollout cannot start or was interrupted (the groups are left at stable 100 %)."""


Decision = Literal["promoted", "rolled_back"]


class StepReport(BaseModel):
    index: int
    percent: float
    started_at: float = Field(description="unix time the weights were set")
    elapsed_s: float = Field(description="seconds from the weight change to the step's verdict")
    checks: int = Field(description="gate evaluations during the hold")
    canary: GroupFigures
    stable: GroupFigures
    baseline_step: int = Field(description="step whose stable figures the canary was compared with")
    passed: bool
    gate: GateResult | None = Field(None, description="the last gate evaluation (None if never judged)")


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
        """The step table the gates judged (one row per step)."""
        return [step_row(s.index, s.percent, s.canary, s.stable, s.baseline_step) for s in self.steps]


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


def run_canary(target: Target, stable: str, canary: str, plan: CanaryPlan, source: MetricsSource,
               progress: Progress | None = None) -> CanaryReport:
    """Roll `canary` out over `stable` in `target` (the controller, a group set, or just a router) following `plan`."""
    admin, _ = _verbs(target)
    names = {g["name"] for g in admin.groups()}
    missing = sorted({stable, canary} - names)
    if missing:
        raise CanaryError(f"groups {missing} are not registered in the router {admin.url}; bring them up first")
    notify = progress or (lambda event: None)
    gates = GateSuite(plan.suite)
    steps: list[StepReport] = []
    try:
        decision, reason = _steps(admin, stable, canary, plan, source, gates, steps, notify)
    except Exception as exc:
        try:
            shift_weights(admin, stable, canary, 0.0)
        except Exception as again:
            raise CanaryError(f"rollout of {canary} interrupted ({exc}) and the rollback failed too: {again}; "
                              f"set the weights by hand") from exc
        raise CanaryError(f"rollout of {canary} interrupted, back to {stable} at 100 %: {exc}") from exc
    return conclude(target, admin, stable, canary, plan, steps, decision, reason, gates, notify)


def _steps(admin: RouterVerbs, stable: str, canary: str, plan: CanaryPlan, source: MetricsSource, gates: GateSuite,
           steps: list[StepReport], notify: Progress) -> tuple[Decision, str]:
    """Hold every step in turn (appending to `steps`); the decision and why, at the first failing step."""
    for index, step in enumerate(plan.steps):
        shift_weights(admin, stable, canary, step.percent)
        report = hold_step(admin, stable, canary, index, step, plan, source, gates, steps, notify)
        steps.append(report)
        if not report.passed:
            why = "; ".join(report.gate.failed) if report.gate else \
                f"only {report.canary.requests:.0f} canary requests within {step.max_hold_s:g}s (need {step.min_requests})"
            return "rolled_back", f"step {index} ({step.percent:g} %) failed: {why}"
        notify(CanaryEvent(kind="step_passed", step=index, percent=step.percent, canary=report.canary, stable=report.stable))
    return "promoted", f"every step passed its gates ({len(steps)} steps)"


def shift_weights(admin: RouterVerbs, stable: str, canary: str, percent: float) -> None:
    admin.set_weights({canary: percent, stable: 100.0 - percent})


def hold_step(admin: RouterVerbs, stable: str, canary: str, index: int, step: CanaryStep, plan: CanaryPlan,
          source: MetricsSource, gates: GateSuite, done: list[StepReport], notify: Progress) -> StepReport:
    """Judge the step's window (its weights already set) until the hold passes or a gate fails."""
    started_at, t0 = time.time(), time.monotonic()
    notify(CanaryEvent(kind="step_started", step=index, percent=step.percent,
                       message=f"{canary} {step.percent:g} %, {stable} {100 - step.percent:g} %"))
    start = source.mark()
    checks = 0
    while True:
        time.sleep(plan.check_interval_s)
        figures = source.figures(start, source.mark(), [stable, canary])
        elapsed = time.monotonic() - t0
        c, s = figures[canary], figures[stable]
        baseline, baseline_step = _baseline(s, index, step, done)
        if c.requests < step.min_requests:
            if elapsed >= step.max_hold_s:
                return StepReport(index=index, percent=step.percent, started_at=started_at, elapsed_s=elapsed,
                                  checks=checks, canary=c, stable=baseline, baseline_step=baseline_step, passed=False)
            continue
        rows = [step_row(r.index, r.percent, r.canary, r.stable, r.baseline_step) for r in done]
        gate = gates.validate(rows + [step_row(index, step.percent, c, baseline, baseline_step)])
        checks += 1
        notify(CanaryEvent(kind="checked", step=index, percent=step.percent, canary=c, stable=baseline,
                           message="pass" if gate.success else "; ".join(gate.failed)))
        if not gate.success or elapsed >= step.hold_s:
            return StepReport(index=index, percent=step.percent, started_at=started_at, elapsed_s=elapsed, checks=checks,
                              canary=c, stable=baseline, baseline_step=baseline_step, passed=gate.success, gate=gate)


def _baseline(stable: GroupFigures, index: int, step: CanaryStep, done: list[StepReport]) -> tuple[GroupFigures, int]:
    """The stable figures of this step, or (when it got too little traffic, as at 100 %) of the latest step that had them."""
    if stable.requests >= step.min_requests or not done:
        return stable, index
    last = done[-1]
    return last.stable, last.baseline_step


def conclude(target: Target, admin: RouterVerbs, stable: str, canary: str, plan: CanaryPlan, steps: list[StepReport],
            decision: Decision, reason: str, gates: GateSuite, notify: Progress) -> CanaryReport:
    promoted = decision == "promoted"
    aftermath = ""
    shift_weights(admin, stable, canary, 100.0 if promoted else 0.0)
    leaving = stable if promoted else canary
    _drain(admin, leaving, plan.drain_s)
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


def _drain(admin: RouterVerbs, name: str, drain_s: float) -> None:
    deadline = time.monotonic() + drain_s
    while admin.inflight(name) and time.monotonic() < deadline:
        time.sleep(0.05)
