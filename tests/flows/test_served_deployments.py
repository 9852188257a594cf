"""The deployments as users run them: `tideflow ui` (a real Prefect server + every deployment served),
a controller in its own process, and flow runs started through Prefect's API, each in a process of its
own. After each run ends, the fleet the controller serves shows what the run did.

Slow (a fresh Prefect database is migrated, groups of the default model start several times): run by
`make test-slow`, which CI runs after the fast suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from engine.control import discovery
from engine.control.models import ScalePool
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.process import free_port, start_service
from flows.deployments import SHIPPED_PREFECT_FILE
from harness.canary import SHARED_CORES_JUDGE
from engine.scaling.policy import Bounds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deployments" / "groups" / "tiny-colocated.yaml"


@pytest.fixture(scope="module")
def controller_model_dir():
    return None  # the default model, written into the home: groups of the shipped specs use it


@pytest.fixture(scope="module")
def served(tideflow_home, controller, tmp_path_factory):
    """`tideflow ui` on a free port, serving the shipped deployments from a copy of prefect.yaml (passed with
    --prefect-file): the canary trigger's plan shortened for a laptop, and the cron schedules left out, so
    that a scheduled run (08:00 in Shanghai is 00:00 UTC) cannot scale the fleet in the middle of a test."""
    shipped = yaml.safe_load(SHIPPED_PREFECT_FILE.read_text())
    for deployment in shipped["deployments"]:
        deployment.pop("schedules", None)
    (canary,) = [d for d in shipped["deployments"] if d["name"] == "canary-release"]
    canary["triggers"][0]["parameters"]["params"]["plan"] = {
        "steps": [{"percent": p, "hold_s": 3, "max_hold_s": 120} for p in (50, 100)],
        "judge": SHARED_CORES_JUDGE.model_dump(), "drain_s": 5}
    prefect_file = tmp_path_factory.mktemp("prefect") / "prefect.yaml"
    prefect_file.write_text(yaml.safe_dump(shipped, sort_keys=False))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_HOME": str(tideflow_home / "prefect")}
    ui = start_service("tideflow-ui", [sys.executable, "-m", "flows.cli", "ui", "--port", str(port),  # a pipeline command
                                       "--prefect-file", str(prefect_file)],
                       tideflow_home / "logs" / "ui.log", api + "/health", timeout_s=300, env=env)
    try:
        with httpx.Client(base_url=api, trust_env=False, timeout=10) as prefect:
            _until(lambda: prefect.get("/deployments/name/canary_release/canary-release").status_code == 200, 300, ui)
        yield {**os.environ, **env, "PREFECT_API_URL": api}
    finally:
        ui.stop(grace_s=90)


def _until(check, timeout_s: float, child=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert child is None or child.alive(), child.log_tail()
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.5)


def run_deployment(env: dict, name: str, params: dict) -> None:
    """`prefect deployment run NAME --watch`: the run happens in the served process's child, not here."""
    done = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", name, "--param",
                           f"params={json.dumps(params)}", "--watch", "--watch-timeout", "900"],
                          env=env, capture_output=True, text=True, timeout=960)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Completed" in done.stdout, done.stdout[-3000:]


def states(controller) -> dict[str, GroupState]:
    return {g.name: g.state for g in controller.status().groups}


def serve_exactly(controller, n: int) -> None:
    """Precondition straight through the control API (each test can run alone): n Ready pool groups."""
    template = InferenceGroup.from_yaml(TEMPLATE)
    controller.scale_pool(ScalePool(template=template, target=n, floor=n, warm_pool=1,
                                    bounds=Bounds(min_groups=0, max_groups=3)))
    _until(lambda: sum(s == GroupState.READY for s in states(controller).values()) == n, 300)


def test_tidal_scale_up_then_down_through_the_prefect_api(served, controller):
    bounds = {"min_groups": 0, "max_groups": 3}
    run_deployment(served, "tidal_scale/tidal-scale-up",
                   {"target": 2, "warm_pool": 0, "spec_file": str(TEMPLATE), "bounds": bounds})
    _until(lambda: sorted(n for n, s in states(controller).items() if s == GroupState.READY)
           == ["tiny-colocated-0", "tiny-colocated-1"], 300)
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
                   {"group": serving[0], "target": "colocated", "repeats": 1, "rate": 2, "duration_s": 3})
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
        _until(lambda: (c := controller.status().canary) is not None and c.canary == "tideflow-v7"
               and c.decision is not None, 900)
    finally:
        stop.set()
        pump.join(timeout=120)
    canary = controller.status().canary
    assert canary.stable == stable, canary
    assert canary.decision == "promoted", canary.reason
    assert controller.group("tideflow-v7").weight == 100.0
    assert answered and all(answered)
