"""canary_release: bring the new version up at weight 0, shift traffic step by step behind metric gates,
then promote it or roll back."""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel, Field

from engine.canary import CanaryPlan
from engine.canary.rollout import CanaryReport
from flows.deploy_group import deploy_group
from flows.params import DeployParams
from tasks.canary import collect_metrics, promote, rollback, shift_traffic, validate_metrics


class CanaryParams(BaseModel):
    stable: str = Field("tiny-pd", description="the group serving now")
    canary: DeployParams = Field(default_factory=lambda: DeployParams(name="tiny-pd-canary", version="v2", weight=0.0),
                                 description="the new version's group (comes up at weight 0)")
    plan: CanaryPlan = Field(default_factory=CanaryPlan, description="steps, holds, gates, what follows")
    prometheus_url: str | None = Field(None, description="query Prometheus instead of scraping /metrics directly")


@flow(name="canary_release", log_prints=True)
def canary_release(params: CanaryParams = CanaryParams()) -> CanaryReport:
    name = deploy_group(params.canary.model_copy(update={"weight": 0.0})).name
    steps = []
    for index, step in enumerate(params.plan.steps):
        shift_traffic(params.stable, name, step.percent, params.canary.groupset)
        report = collect_metrics(params.stable, name, index, step, params.plan, steps, params.prometheus_url,
                                 params.canary.groupset)
        steps.append(report)
        failed = report.gate.failed if report.gate else [f"only {report.canary.requests:.0f} canary requests in the hold"]
        if report.passed:
            gate = validate_metrics(steps, params.plan)
            failed = gate.failed if not gate.success else []
        if failed:
            return rollback(params.stable, name, params.plan, steps,
                            f"step {index} ({step.percent:g} %) failed: {'; '.join(failed)}", params.canary.groupset)
    return promote(params.stable, name, params.plan, steps, params.canary.groupset)
