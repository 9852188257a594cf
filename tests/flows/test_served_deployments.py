"""The deployments as users run them: `tideflow ui` (a real Prefect server + every deployment served),
a controller in its own process, and flow runs started through Prefect's API, each in a process of its
own. After each run ends, the fleet the controller serves shows what the run did.

Slow (a fresh Prefect database is migrated, groups of the default model start several times): run by
`make test-slow`, which CI runs after the fast suite.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import openai
import pytest

from engine.control import discovery
from engine.control.models import ScalePool
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds
from tests.flows.served import flow_runs, prefect_file_for_tests, run_deployment, start_ui, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deployments" / "groups" / "tiny-colocated.yaml"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}  # Prefect's terminal state types


@pytest.fixture(scope="module")
def controller_model_dir():
    return None  # the default model, written into the home: groups of the shipped specs use it


@pytest.fixture(scope="module")
def served(tideflow_home, controller, tmp_path_factory):
    """`tideflow ui` on a free port, beside the module's controller (it adopts it), serving the shipped
    deployments from a copy of prefect.yaml (served.prefect_file_for_tests)."""
    ui, env = start_ui(tideflow_home, prefect_file_for_tests(tmp_path_factory.mktemp("prefect")))
    try:
        yield env
    finally:
        ui.stop(grace_s=90)


def states(controller) -> dict[str, GroupState]:
    return {g.name: g.state for g in controller.status().groups}


def serve_exactly(controller, n: int) -> None:
    """Precondition straight through the control API (each test can run alone): n Ready pool groups."""
    template = InferenceGroup.from_yaml(TEMPLATE)
    controller.scale_pool(ScalePool(template=template, target=n, floor=n, warm_pool=1,
                                    bounds=Bounds(min_groups=0, max_groups=3)))
    until(lambda: sum(s == GroupState.READY for s in states(controller).values()) == n, 300)


def test_tidal_scale_up_then_down_through_the_prefect_api(served, controller):
    bounds = {"min_groups": 0, "max_groups": 3}
    run_deployment(served, "tidal_scale/tidal-scale-up",
                   {"target": 2, "warm_pool": 0, "spec_file": str(TEMPLATE), "bounds": bounds})
    # the run ended once both cold starts served, not 1 s after asking for them
    assert sorted(n for n, s in states(controller).items() if s == GroupState.READY) == ["tiny-colocated-0",
                                                                                        "tiny-colocated-1"]
    run_deployment(served, "tidal_scale/tidal-scale-down",
                   {"target": 1, "floor": 1, "warm_pool": 1, "spec_file": str(TEMPLATE), "bounds": bounds})
    now = states(controller)
    assert sorted(now.values()) == [GroupState.READY, GroupState.STANDBY], now


def test_nightly_drills_run_as_deployments_against_the_fleet(served, controller):
    serve_exactly(controller, 1)
    run_deployment(served, "load_drill/load-drill-nightly", {"steps": [1.0, 2.0], "hold_s": 3, "output_len": "fixed:8"})
    serving = [n for n, s in states(controller).items() if s == GroupState.READY]
    before = {n: controller.group(n).handle for n in serving}
    run_deployment(served, "fault_drill/fault-drill-nightly",
                   {"group": serving[0], "target": "colocated", "repeats": 1, "rate": 2, "duration_s": 3},
                   expect="Failed")  # it serves: refused without allow_serving (the shipped nightly parameters set it)
    assert controller.group(serving[0]).handle == before[serving[0]]
    run_deployment(served, "fault_drill/fault-drill-nightly",
                   {"group": serving[0], "target": "colocated", "repeats": 1, "rate": 2, "duration_s": 3,
                    "allow_serving": True})
    after = controller.group(serving[0])
    assert after.handle != before[serving[0]]  # rebuilt whole: Ready again, or into the pool when the standby took over
    assert after.state in (GroupState.READY, GroupState.STANDBY)
    assert sum(s == GroupState.READY for s in states(controller).values()) == 1  # capacity back
    assert any(e.kind == "kill" and serving[0] in e.message for e in controller.events())


def test_published_weights_trigger_a_canary_on_the_serving_fleet(served, controller):
    serve_exactly(controller, 1)
    (stable,) = [n for n, s in states(controller).items() if s == GroupState.READY]
    router = openai.OpenAI(base_url=controller.status().router_url + "/v1", api_key=discovery.router_key(),
                           max_retries=2, timeout=60)
    stop = threading.Event()
    answered: list[bool] = []

    def traffic() -> None:  # the canary's gates judge real requests
        while not stop.is_set():
            try:
                router.completions.create(model="default", prompt="steady traffic", max_tokens=4)
                answered.append(True)
            except openai.APIError:
                answered.append(False)

    pump = threading.Thread(target=traffic, daemon=True)
    pump.start()
    try:
        run_deployment(served, "publish_weights/publish-weights", {"version": "v7", "seed": 1})
        until(lambda: (c := controller.status().canary) is not None and c.canary == "tideflow-v7"
               and c.decision is not None, 900)
    finally:
        stop.set()
        pump.join(timeout=120)
    canary = controller.status().canary
    assert canary.stable == stable, canary
    assert canary.decision == "promoted", canary.reason
    assert controller.group("tideflow-v7").weight == 100.0
    assert answered and all(answered)
    # the controller shows the decision while the run still records its last steps: wait for the run to end
    until(lambda: all(r["state"]["type"] in FINAL for r in flow_runs(served, "canary-release")), 300)
    (run,) = flow_runs(served, "canary-release")  # the trigger fired once
    assert run["state"]["type"] == "COMPLETED", run["state"]


def test_kv_gc_deletes_exactly_the_expired_blocks_from_a_deployment_run(served, controller, tmp_path):
    """The scheduled sweep, run as the schedule runs it: a directory store (no lifecycle rules) loses the blocks
    older than its TTL and keeps the rest and everything that is not KV."""
    store = tmp_path / "kv-store"
    kept, expired = store / "kv/default/v1/salt/fresh", store / "kv/default/v1/salt/old"
    weights = store / "models/default/v1/weights.bin"
    for path, age_days in ((kept, 0.5), (expired, 3), (weights, 9)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"block")
        then = time.time() - age_days * 86400
        os.utime(path, (then, then))
    out = run_deployment(served, "kv_gc/kv-gc", {"extra_stores": {store.as_uri() + "/": 86400}})
    assert kept.exists() and weights.exists() and not expired.exists(), out[-2000:]


def test_a_capacity_plan_applied_from_a_deployment_run_is_the_autoscalers_schedule(served, controller, tmp_path):
    """capacity-plan with apply, run by the served deployment: the controller's autoscaler over the template's pool
    takes the plan's hourly groups as its schedule and floors (stopped again after: it would keep scaling)."""
    from engine.capacity.apply import policy_from_plan
    from engine.capacity.forecast import from_csv
    from engine.capacity.plan import plan
    from tests.engine.capacity.shapes import SPEC, shape

    profile, forecast = tmp_path / "shape.json", tmp_path / "day.csv"
    profile.write_text(shape().model_dump_json())
    forecast.write_text("\n".join(f"{h},{1 if h < 12 else 2}" for h in range(24)))  # one group all day: nothing starts
    params = {"profile": str(profile), "plan": SPEC.model_dump(mode="json"), "forecast_csv": str(forecast),
              "timezone": "Europe/Paris", "apply": True, "spec_file": str(TEMPLATE)}
    run_deployment(served, "capacity_plan/capacity-plan", params)
    pool = InferenceGroup.from_yaml(TEMPLATE)
    try:
        view = controller.autoscaler(pool.name)
        # the plan is deterministic: the same inputs here give the policy the run must have applied
        expected = policy_from_plan(plan(SPEC, from_csv(forecast, "Europe/Paris"), shape()), pool)
        assert view.policy.schedule == expected.schedule and view.policy.schedule.timezone == "Europe/Paris"
        assert view.policy.bounds == expected.bounds and view.policy.warm_pool == expected.warm_pool
        assert [(e.groups, e.floor) for e in view.policy.schedule.entries] == [(1, 1)]
    finally:
        controller.stop_autoscaler(pool.name)
