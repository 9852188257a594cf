"""canary_release: bring the new version up at weight 0, shift traffic step by step behind metric gates,
then promote it or roll back. A rollback ends the run Failed (state "RolledBack"), with the verdict in its
artifacts: a release that did not happen is never shown green."""

from __future__ import annotations

from prefect import flow
from prefect.states import Completed, Failed, State
from pydantic import BaseModel, Field

from engine.canary import CanaryPlan
from engine.canary.rollout import CanaryError, CanaryReport
from engine.control.client import ControlClient
from engine.control.models import GroupView, describe_fleet
from engine.runtime.errors import TideflowError
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from flows.deploy_group import deploy_group
from flows.params import DeployParams
from tasks.canary import collect_metrics, promote, rollback, shift_traffic, validate_metrics
from tasks.kv import kv_remove_version
from tasks.fleet import changing_fleet

ROLLED_BACK = "RolledBack"


class CanaryRolledBack(TideflowError):
    """What a rolled-back canary's Failed state holds: the verdict as the run's error, the whole report with it."""

    def __init__(self, report: CanaryReport) -> None:
        super().__init__(f"{report.canary} rolled back, {report.stable} serves: {report.reason}")
        self.report = report

    def __reduce__(self):  # results are pickled: rebuild from the report, not from the message
        return CanaryRolledBack, (self.report,)


class CanaryParams(BaseModel):
    stable: str | None = Field(None, description="the group serving now (default: the serving group of another "
                                                 "version with the most traffic)")
    canary: DeployParams = Field(default_factory=lambda: DeployParams(name="tiny-pd-canary", version="v2", weight=0.0),
                                 description="the new version's group (comes up at weight 0)")
    plan: CanaryPlan = Field(default_factory=CanaryPlan, description="steps, holds, gates, what follows")
    prometheus_url: str | None = Field(None, description="query Prometheus instead of scraping /metrics directly")


def stable_group(groups: list[GroupView], canary: str, version: str | None) -> str:
    """What an event-triggered canary replaces: of the groups serving another version than the canary's, the one
    with the most traffic (a tidal pool beside the release group serves at a small weight and is not it)."""
    serving = [g for g in groups if g.serving and g.name != canary and (version is None or g.version != version)]
    if not serving:
        raise CanaryError(f"params.stable is unset and no group of another version serves: nothing to replace "
                          f"(fleet: {describe_fleet(groups)})")
    top = max(g.weight for g in serving)
    leaders = sorted(g.name for g in serving if g.weight == top)
    if len(leaders) > 1:
        raise CanaryError(f"params.stable is unset and {', '.join(leaders)} serve with the same weight {top:g}: "
                          "name the stable group")
    return leaders[0]


def already_serving(groups: list[GroupView], canary: str) -> GroupView | None:
    """The canary's group when it takes traffic already (this version was rolled out before)."""
    return next((g for g in groups if g.name == canary and g.weight > 0 and g.state != GroupState.STOPPED), None)


@flow(name="canary_release", log_prints=True)
def canary_release(params: CanaryParams = CanaryParams()) -> State:
    """Completed with the report when promoted; Failed ("RolledBack") holding CanaryRolledBack when rolled back."""
    name = params.canary.name or "canary"
    with ControlClient.connect() as client:
        groups = client.status().groups
    serving = already_serving(groups, name)
    if serving is not None:
        raise CanaryError(f"group {name} already serves {serving.version} at weight {serving.weight:g}: this version "
                          "was rolled out before; nothing to canary")
    stable = params.stable or stable_group(groups, name, params.canary.version)
    stable_spec = next((g.spec for g in groups if g.name == stable), None)
    with changing_fleet(f"canary {name} over {stable}"):
        report, canary_spec = _roll_out(params, stable)
        _forget_kv(report, params.plan, stable_spec, canary_spec)
    if report.decision == "promoted":
        return Completed(message=f"{name} promoted over {stable}: {report.reason}", data=report)
    rolled_back = CanaryRolledBack(report)
    return Failed(name=ROLLED_BACK, message=str(rolled_back), data=rolled_back)


def _forget_kv(report: CanaryReport, plan: CanaryPlan, stable: InferenceGroup | None,
               canary: InferenceGroup | None) -> None:
    """A rolled-back version's KV blocks leave the shared store; so do a retired stable version's (removed on
    promotion: a parked one keeps them for a rollback to it)."""
    leaving = canary if report.decision != "promoted" else (stable if plan.on_promote == "remove" else None)
    if leaving is not None:
        kv_remove_version(leaving)


def _roll_out(params: CanaryParams, stable: str) -> tuple[CanaryReport, InferenceGroup | None]:
    view = deploy_group(params.canary.model_copy(update={"weight": 0.0}))
    return _steps(params, stable, view.name), view.spec


def _steps(params: CanaryParams, stable: str, name: str) -> CanaryReport:
    steps = []
    try:
        for index, step in enumerate(params.plan.steps):
            shift_traffic(stable, name, step.percent, index)
            report = collect_metrics(stable, name, index, step, params.plan, steps, params.prometheus_url)
            steps.append(report)
            failed = [] if report.passed else [report.failures()]
            if report.passed:
                gate = validate_metrics(steps, params.plan)
                failed = gate.failed if not gate.success else []
            if failed:
                return rollback(stable, name, params.plan, steps,
                                f"step {index} ({step.percent:g} %) failed: {'; '.join(failed)}")
    except BaseException:
        shift_traffic(stable, name, 0.0)  # any failure mid-rollout: everything back on the stable group
        raise
    return promote(stable, name, params.plan, steps)
