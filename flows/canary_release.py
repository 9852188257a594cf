"""canary_release: bring the new version up at weight 0, shift traffic step by step behind metric gates,
then promote it or roll back."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, Field

from engine.canary import CanaryPlan
from engine.canary.rollout import CanaryError, CanaryReport
from engine.control.client import ControlClient
from flows.deploy_group import deploy_group
from flows.params import DeployParams
from tasks.canary import collect_metrics, promote, rollback, shift_traffic, validate_metrics


class CanaryParams(BaseModel):
    stable: str | None = Field(None, description="the group serving now (default: the one serving group of the fleet)")
    canary: DeployParams = Field(default_factory=lambda: DeployParams(name="tiny-pd-canary", version="v2", weight=0.0),
                                 description="the new version's group (comes up at weight 0)")
    plan: CanaryPlan = Field(default_factory=CanaryPlan, description="steps, holds, gates, what follows")
    prometheus_url: str | None = Field(None, description="query Prometheus instead of scraping /metrics directly")


def serving_group(exclude: str) -> str:
    """The one group taking traffic now (an event-triggered canary names no stable group)."""
    with ControlClient.connect() as client:
        serving = sorted(g["name"] for g in client.groups() if g["weight"] > 0 and g["name"] != exclude)
    if len(serving) != 1:
        raise CanaryError(f"params.stable is unset and {len(serving)} groups serve ({', '.join(serving) or 'none'}): "
                          "name the stable group")
    return serving[0]


@flow(name="canary_release", log_prints=True)
def canary_release(params: CanaryParams = CanaryParams()) -> CanaryReport:
    stable = params.stable or serving_group(exclude=params.canary.name or "")
    name = deploy_group(params.canary.model_copy(update={"weight": 0.0})).name
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
