"""release: build kernels -> publish + verify -> deploy -> canary -> drills -> the new version serving.

On embedded defaults (a laptop, `make run`) the stable version v1 is brought up first when no
group serves yet, and background traffic runs during the canary so its gates have requests to judge.
"""

from __future__ import annotations

import threading
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, Failed, State
from pydantic import BaseModel, Field

from engine.canary import CanaryPlan, CanaryStep
from engine.canary.judge import JudgeConfig
from drills.load import run_load_drill as background_load
from drills.spec import LoadDrillSpec
from engine.control.client import ControlClient
from engine.runtime.errors import TideflowError
from flows.build_kernels import build_kernels
from flows.canary_release import ROLLED_BACK, CanaryParams, CanaryRolledBack, canary_release
from flows.deploy_group import deploy_group
from flows.drill_flows import FaultDrillParams, LoadDrillParams, fault_drill, fleet_router, load_drill
from flows.params import DeployParams, WeightsParams
from flows.publish_weights import publish_weights
from tasks.fleet import changing_fleet
from tideflow_kernels.spec import BuildRequest


def embedded_plan() -> CanaryPlan:
    """The production judge and suite with a laptop's evidence: each step passes on a horizon of 30 canary
    requests (its false-rollback budget is the same; what shrinks is the degradation it can see), and the
    first step is 25 % so that a few requests a second reach it; a production plan holds minutes."""
    return CanaryPlan(steps=[CanaryStep(percent=p, hold_s=4, max_hold_s=120) for p in (25, 50, 100)],
                      judge=JudgeConfig(horizon=30), drain_s=10)


class ReleaseParams(BaseModel):
    kernels: BuildRequest = Field(default_factory=BuildRequest, description="ops to build first")
    stable_weights: WeightsParams = Field(default_factory=lambda: WeightsParams(version="v1", seed=0))
    new_weights: WeightsParams = Field(default_factory=lambda: WeightsParams(version="v2", seed=1))
    spec_file: Path = Field(Path("deployments/groups/tiny-pd.yaml"), description="shape of both versions' groups")
    stable_group: str = Field("tideflow-v1", description="group serving the current version")
    new_group: str = Field("tideflow-v2", description="group of the new version")
    plan: CanaryPlan = Field(default_factory=embedded_plan)
    canary_traffic_rps: float = Field(8.0, gt=0, description="background requests/s while the canary runs (0 = none)")
    load: LoadDrillParams = Field(default_factory=lambda: LoadDrillParams(steps=[1.0, 2.0, 4.0], hold_s=4.0))
    fault: FaultDrillParams = Field(default_factory=lambda: FaultDrillParams(repeats=1, standby=True),
                                    description="drill of the winner; with a warm standby copy it must lose nothing")


class ReleaseSummary(BaseModel):
    router: str
    kernels_ok: bool
    weights: dict[str, str]
    canary_decision: str
    canary_reason: str
    serving: dict[str, float]
    load_capacity_rps: float | None
    load_sent: int
    load_ok: int
    load_error: int
    load_accounted: bool
    fault_recover_s: list[float | None]
    fault_accounted: bool
    fault_errors: int
    fault_migrated: int
    fault_lost_tokens: int
    fault_duplicated_tokens: int
    fault_clean: bool = Field(description="every request ok and exact, the group rebuilt whole: the release gate")
    canary_traffic: dict[str, int]


class ReleaseFailed(TideflowError):
    """What a failed release's state holds: why, and the summary of everything it did."""

    def __init__(self, why: str, summary: ReleaseSummary) -> None:
        super().__init__(why)
        self.summary = summary

    def __reduce__(self):
        return ReleaseFailed, (str(self), self.summary)


@flow(name="release", log_prints=True)
def release(params: ReleaseParams = ReleaseParams()) -> State:
    """Completed with the summary when the new version was promoted and every drill held; Failed otherwise
    (RolledBack when the canary was), still with the summary and its artifact."""
    with changing_fleet("release"):
        summary = _release(params)
    create_markdown_artifact(key="release-summary", markdown=_markdown(summary))
    if summary.canary_decision != "promoted":
        failed = ReleaseFailed(f"canary rolled back: {summary.canary_reason}", summary)
        return Failed(name=ROLLED_BACK, message=str(failed), data=failed)
    if not (summary.fault_clean and summary.load_accounted):
        failed = ReleaseFailed("the drills did not hold: see the release summary", summary)
        return Failed(message=str(failed), data=failed)
    return Completed(message=f"{params.new_group} serves", data=summary)


def _release(params: ReleaseParams) -> ReleaseSummary:
    kernels = build_kernels(params.kernels)
    # published without the event: this run canaries the new version itself, the trigger would start a second
    stable_url = publish_weights(params.stable_weights.model_copy(update={"announce": False}))
    new_url = publish_weights(params.new_weights.model_copy(update={"announce": False}))
    with ControlClient.connect() as client:
        serving = {g["name"] for g in client.groups() if g["weight"] > 0}
    if params.stable_group not in serving:
        deploy_group(DeployParams(spec_file=params.spec_file, name=params.stable_group, version="v1",
                                  weights_url=stable_url, weight=100.0))
    traffic: dict = {}
    pump, stop = _background_traffic(params, traffic)
    try:
        state = canary_release(CanaryParams(
            stable=params.stable_group, plan=params.plan,
            canary=DeployParams(spec_file=params.spec_file, name=params.new_group, version="v2", weights_url=new_url)),
            return_state=True)
        outcome = state.result(raise_on_failure=False)
        if isinstance(outcome, CanaryRolledBack):
            report = outcome.report  # rolled back: the release drills the stable group, then ends Failed
        elif state.is_failed():
            state.result()  # raises the canary's own error
        else:
            report = outcome
    finally:
        stop.set()
        if pump is not None:
            pump.join()
    winner = params.new_group if report.decision == "promoted" else params.stable_group
    drill = load_drill(params.load)
    fault = fault_drill(params.fault.model_copy(update={"group": winner, "allow_serving": True}))
    router_url, _ = fleet_router()
    return ReleaseSummary(
        router=router_url, kernels_ok=kernels.ok, weights={"v1": stable_url, "v2": new_url},
        canary_decision=report.decision, canary_reason=report.reason, serving=report.weights,
        load_capacity_rps=drill.capacity_rps, load_sent=drill.sent, load_ok=drill.ok, load_error=drill.error,
        load_accounted=drill.accounted,
        fault_recover_s=[r.recover_s for r in fault.runs], fault_accounted=fault.accounted, fault_errors=fault.errors,
        fault_migrated=fault.migrated, fault_lost_tokens=fault.lost_tokens,
        fault_duplicated_tokens=fault.duplicated_tokens, fault_clean=fault.clean, canary_traffic=traffic)


def _background_traffic(params: ReleaseParams, out: dict) -> tuple[threading.Thread | None, threading.Event]:
    """Steady Poisson load through the router until `stop` is set (bounded by the canary's longest run)."""
    stop = threading.Event()
    if params.canary_traffic_rps <= 0:
        return None, stop
    duration = 60.0 + sum(s.max_hold_s for s in params.plan.steps)
    url, key_env = fleet_router()
    spec = LoadDrillSpec(url=url, model="default", api_key_env=key_env, rate=params.canary_traffic_rps,
                         duration_s=duration, output_len="fixed:16", expectations_suite=None, progress_bar=False,
                         flow_run_id=flow_run.id)

    def run() -> None:
        r = background_load(spec, stop=stop)
        out.update(sent=r.sent, ok=r.ok, error=r.error)

    thread = threading.Thread(target=run, name="canary-traffic", daemon=True)
    thread.start()
    return thread, stop


def _markdown(s: ReleaseSummary) -> str:
    return (f"## Release\n\n- kernels built and verified: {s.kernels_ok}\n- weights: {s.weights}\n"
            f"- canary: **{s.canary_decision}** ({s.canary_reason})\n- serving weights: {s.serving}\n"
            f"- traffic during the canary: {s.canary_traffic}\n"
            f"- load drill: capacity {s.load_capacity_rps} req/s, {s.load_ok}/{s.load_sent} ok\n"
            f"- fault drill: recovered in {s.fault_recover_s} s, every request accounted for: {s.fault_accounted}, "
            f"{s.fault_errors} errors, {s.fault_migrated} migrated, lost tokens {s.fault_lost_tokens}, "
            f"duplicated {s.fault_duplicated_tokens}: {'clean' if s.fault_clean else '**not clean**'}\n"
            f"- router: {s.router}/v1\n")
