"""shift_traffic, collect_metrics, validate_metrics, promote, rollback: the canary, one verb each.

Weights go through the controller (which keeps them as desired state), so a canary run from an event
trigger acts on the fleet that serves.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from engine.canary import CanaryPlan, CanaryStep, DirectSource, PrometheusSource
from engine.canary.gates import GateResult, GateSuite, step_row
from engine.canary.rollout import CanaryReport, StepReport, conclude, hold_step, judge_table, shift_weights
from engine.canary.samples import RouterSamples
from engine.control import discovery
from engine.control.client import ControlClient
from engine.control.models import CanaryRecord
from engine.telemetry import tracing
from tasks.retry import BACKOFF, JITTER


def _source(client: ControlClient, prometheus_url: str | None):
    if prometheus_url:
        return PrometheusSource(prometheus_url)
    return DirectSource.for_controller(client, discovery.router_key())


@task(name="shift_traffic", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=60)
def shift_traffic(stable: str, canary: str, percent: float, step: int = -1) -> None:
    """Weights of both groups, and the step recorded in the controller (`tideflow status` shows it)."""
    with ControlClient.connect() as client:
        shift_weights(client, stable, canary, percent)
        client.record_canary(CanaryRecord(stable=stable, canary=canary, step=step, percent=percent))
    get_run_logger().info("traffic: %s %g %%, %s %g %%", canary, percent, stable, 100 - percent)


@task(name="collect_metrics", cache_policy=NO_CACHE, timeout_seconds=3600)
def collect_metrics(stable: str, canary: str, index: int, step: CanaryStep, plan: CanaryPlan, done: list[StepReport],
                    prometheus_url: str | None = None) -> StepReport:
    """Hold the step: the judge looks at both groups' per-request samples every check, so a bad canary leaves
    as soon as the evidence is clear; the suite runs on the judge table at the step's end."""
    logger = get_run_logger()
    tracing.setup("canary")  # the judge's verdict per step, as spans (engine/telemetry/tracing.py)
    with ControlClient.connect() as client:
        source = _source(client, prometheus_url)
        samples = RouterSamples(lambda: client.status().replica_urls(), discovery.router_key(), [stable, canary])
        try:
            report = hold_step(stable, canary, index, step, plan, source, samples, GateSuite(plan.suite_path()), done,
                               lambda e: logger.info("step %d %s: %s", e.step, e.kind, e.message),
                               {tracing.FLOW_RUN: str(flow_run.id)} if flow_run.id else None)
        finally:
            samples.close()
            source.close()
    create_table_artifact(key=f"canary-step-{index}", description=f"step {index}: the judge at canary {step.percent:g} %",
                          table=[v.model_dump() for v in report.verdicts])
    create_table_artifact(key=f"canary-step-{index}-figures", description=f"step {index}: canary and stable figures",
                          table=[{"group": "canary", **report.canary.model_dump()}, {"group": "stable", **report.stable.model_dump()}])
    return report


@task(name="validate_metrics", cache_policy=NO_CACHE, timeout_seconds=300)
def validate_metrics(steps: list[StepReport], plan: CanaryPlan) -> GateResult:
    """The Great Expectations suite over the whole judge table; no retries: a failed gate fails again."""
    result = GateSuite(plan.suite_path()).validate(judge_table(steps))
    create_table_artifact(key="canary-steps", description="per-step figures, canary vs stable",
                          table=[step_row(s.index, s.percent, s.canary, s.stable, s.baseline_step) for s in steps])
    create_markdown_artifact(key="canary-gates", markdown=(
        f"### Canary gates: {'pass' if result.success else 'FAIL'}\n\n"
        + ("\n".join(f"- {f}" for f in result.failed) or "every expectation met")
        + f"\n\n```json\n{_short_json(result.validation)}\n```"))
    return result


def _short_json(validation: dict) -> str:
    import json

    return json.dumps(validation, indent=1, default=str)[:20000]


def _conclude(decision: str, stable: str, canary: str, plan: CanaryPlan, steps: list[StepReport],
              reason: str) -> CanaryReport:
    with ControlClient.connect() as client:
        report = conclude(client, client, stable, canary, plan, steps, decision, reason, GateSuite(plan.suite_path()),
                          lambda e: None)
        client.record_canary(CanaryRecord(stable=stable, canary=canary, step=steps[-1].index if steps else -1,
                                          percent=report.weights.get(canary, 0.0) if decision == "promoted" else 0.0,
                                          decision=decision, reason=reason))
    create_markdown_artifact(key="canary-decision", markdown=f"### {canary} over {stable}: **{decision}**\n\n{reason}\n\n"
                             f"weights after: {report.weights}"
                             + (f"\n\nafterwards: {report.aftermath}" if report.aftermath else ""))
    return report


@task(name="promote", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=300)
def promote(stable: str, canary: str, plan: CanaryPlan, steps: list[StepReport]) -> CanaryReport:
    """Canary to 100 %; the stable group is drained and parked (or removed, by plan)."""
    return _conclude("promoted", stable, canary, plan, steps, f"every step passed its gates ({len(steps)} steps)")


@task(name="rollback", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=300)
def rollback(stable: str, canary: str, plan: CanaryPlan, steps: list[StepReport], reason: str) -> CanaryReport:
    """Canary to 0 %, stable to 100 %; the canary is kept for inspection (or removed, by plan)."""
    return _conclude("rolled_back", stable, canary, plan, steps, reason)
