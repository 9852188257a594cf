"""The release flow end to end on the default model: every pipeline flow runs as its subflow."""

from __future__ import annotations

from pathlib import Path

from engine.canary import CanaryPlan, CanaryStep
from engine.canary.judge import JudgeConfig
from engine.control.client import ControlClient
from flows.drills import FaultDrillParams, LoadDrillParams
from flows.release import ReleaseParams, release
from kernels.spec import BuildRequest

REPO = Path(__file__).resolve().parents[2]


def test_release_promotes_the_new_version_and_drills_it(flow_home):
    params = ReleaseParams(
        kernels=BuildRequest(target="all", arch="native", bench_iters=2),
        spec_file=REPO / "deployments" / "groups" / "tiny-pd.yaml",
        plan=CanaryPlan(steps=[CanaryStep(percent=p, hold_s=3, max_hold_s=90) for p in (25, 100)],
                        judge=JudgeConfig(horizon=30), drain_s=5),
        canary_traffic_rps=6.0,
        load=LoadDrillParams(steps=[1.0, 2.0], hold_s=3.0, output_len="fixed:8"),
        fault=FaultDrillParams(repeats=1, rate=2.0, duration_s=3.0, standby=True),
    )
    state = release(params, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.kernels_ok
    assert summary.weights["v1"].endswith("/models/default/v1/") and summary.weights["v2"].endswith("/v2/")
    assert summary.canary_decision == "promoted", summary.canary_reason
    assert summary.serving["tideflow-v2"] == 100.0 and summary.serving.get("tideflow-v1", 0.0) == 0.0
    traffic = summary.canary_traffic
    assert traffic["sent"] == traffic["ok"] + traffic["error"] and traffic["sent"] > 0
    assert summary.load_accounted and summary.load_sent == summary.load_ok + summary.load_error
    assert summary.load_ok > 0
    assert summary.fault_accounted and all(r is not None for r in summary.fault_recover_s)
    assert summary.fault_errors == 0 and summary.fault_lost_tokens == 0 and summary.fault_duplicated_tokens == 0
    assert summary.fault_clean
    with ControlClient.connect() as client:  # the drill's standby copy is gone, the winner serves under its name
        serving = {g["name"]: g["weight"] for g in client.groups()}
    assert serving.get("tideflow-v2", 0) > 0 and "tideflow-v2-warm" not in serving
