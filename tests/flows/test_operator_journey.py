"""The operator's day from the Prefect UI, as a person runs it: `tideflow ui` starts the Prefect server, its own
controller and every shipped deployment; each step is a `prefect deployment run --watch` whose run happens in a
process of the UI's; the fleet is read after each step with `tideflow status --json`. Then the UI's controller is
SIGKILLed and one started by hand takes over under streamed load, and stopping the UI leaves it serving.

Slow (a fresh Prefect database, groups of the default model): `make test-slow` (CI) or `make journey`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

from engine.control import discovery
from engine.control.client import ControlClient
from engine.runtime.process import start_service, start_ticks, tideflow_argv
from tasks.weights import PUBLISHED_EVENT
from engine.control.local_runtime import stop_recorded_fleet
from tests.conftest import assert_nothing_left
from tests.flows.served import events, flow_runs, prefect_file_for_tests, run_deployment, short_plan, start_ui, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
COLOCATED = REPO / "deployments" / "groups" / "tiny-colocated.yaml"


def status() -> dict:
    done = subprocess.run(tideflow_argv("status", "--json"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def groups() -> dict[str, dict]:
    return {g["name"]: g for g in status()["groups"]}


class Traffic:
    """Streamed completions through the router from 3 threads until stopped; each outcome kept."""

    def __init__(self) -> None:
        s = status()
        self.client = openai.OpenAI(base_url=s["router_url"] + "/v1", api_key=discovery.router_key(), max_retries=0,
                                    timeout=60)
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(3)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream = self.client.completions.create(model="default", prompt="the journey", max_tokens=4,
                                                        stream=True, extra_body={"ignore_eos": True})
                ends = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
                self.outcomes.append("ok" if ends == ["length"] else f"ended {ends}")
            except openai.APIError as exc:
                self.outcomes.append(f"error: {exc}")

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def errors(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]


@pytest.fixture(scope="module")
def journey_home(tideflow_home):
    """The module's TIDEFLOW_HOME; afterwards whatever a failed step left is stopped, and nothing may be left."""
    yield tideflow_home
    stop_recorded_fleet()
    assert_nothing_left(tideflow_home, timeout_s=60)


def test_the_operators_day_from_the_prefect_ui(journey_home, tmp_path_factory):
    specs = tmp_path_factory.mktemp("specs")
    ui, env = start_ui(journey_home, prefect_file_for_tests(specs))
    by_hand = None
    try:
        ui_controller = discovery.find().pid
        assert ui_controller is not None and status()["groups"] == []

        # 1. the serving group, deployed from the UI: the run ends once it is Ready and takes its weight
        run_deployment(env, "deploy_group/deploy-group",
                       {"spec_file": str(COLOCATED), "name": "tideflow-v1", "version": "v1", "weight": 100})
        v1 = groups()["tideflow-v1"]
        assert (v1["state"], v1["weight"]) == ("Ready", 100.0)

        # 2. a typo in the nightly drill's group: refused at once, listing the fleet; nothing killed or deleted
        run_deployment(env, "fault_drill/fault-drill-nightly",
                       {"group": "tideflow-v11", "target": "colocated", "repeats": 1, "allow_serving": True},
                       expect="Failed")
        (typo,) = flow_runs(env, "fault-drill-nightly")
        assert "no group named 'tideflow-v11'" in typo["state"]["message"], typo["state"]
        assert "tideflow-v1 (Ready, weight 100)" in typo["state"]["message"]
        after = groups()["tideflow-v1"]
        assert (after["state"], after["weight"], after["handle"]) == ("Ready", 100.0, v1["handle"])

        # 3. weights published: the trigger canaries them once, against the group the version replaces
        with Traffic() as traffic:
            run_deployment(env, "publish_weights/publish-weights", {"version": "v2", "seed": 1})
            until(lambda: (c := status()["canary"]) is not None and c["canary"] == "tideflow-v2"
                  and c["decision"] is not None, 900)
        canary = status()["canary"]
        assert (canary["stable"], canary["decision"]) == ("tideflow-v1", "promoted"), canary
        (triggered,) = flow_runs(env, "canary-release")  # one canary, not two
        assert triggered["state"]["type"] == "COMPLETED"
        fleet = groups()
        assert fleet["tideflow-v2"]["weight"] == 100.0 and fleet["tideflow-v2"]["state"] == "Ready"
        assert fleet["tideflow-v1"]["state"] == "Standby"  # parked into the warm pool
        assert traffic.outcomes and traffic.errors() == [], traffic.errors()[:3]

        # 4. a publish that says it runs its own canary (the release does) emits no event, so no trigger fires
        run_deployment(env, "publish_weights/publish-weights", {"version": "v3", "seed": 2, "announce": False})
        assert len(events(env, PUBLISHED_EVENT, "tideflow.weights.default.v2")) == 1
        assert events(env, PUBLISHED_EVENT, "tideflow.weights.default.v3") == []

        # 5. a bad canary started by hand is rolled back, and its run is Failed ("RolledBack"), not green
        bad = specs / "bad.yaml"
        spec = yaml.safe_load(COLOCATED.read_text())
        spec["roles"][0]["engine"]["faults"] = {"error_rate": 0.5, "seed": 3}
        bad.write_text(yaml.safe_dump(spec))
        with Traffic() as traffic:
            run_deployment(env, "canary_release/canary-release",
                           {"canary": {"spec_file": str(bad), "name": "tideflow-v3", "version": "v3"},
                            "plan": short_plan()}, expect="RolledBack")
        fleet = groups()
        assert status()["canary"]["decision"] == "rolled_back"
        assert fleet["tideflow-v2"]["weight"] == 100.0 and fleet["tideflow-v3"]["weight"] == 0.0
        assert traffic.errors() == [], traffic.errors()[:3]  # the router retried the canary's errors on v2

        # 6. the UI's controller is SIGKILLed; one started by hand takes its port back and adopts everything
        before, url = status(), discovery.find().url
        members = {g["name"]: [m["pid"] for m in g["members"]] for g in before["groups"]}
        with Traffic() as traffic:
            time.sleep(1.0)
            os.kill(ui_controller, signal.SIGKILL)
            time.sleep(1.0)  # requests keep flowing with no controller at all
            by_hand = start_service("controller-by-hand", tideflow_argv("controller"),  # no --port: it takes its own
                                    journey_home / "logs" / "by-hand.log", url + "/health", timeout_s=120)
            until(lambda: len(traffic.outcomes) >= 280, 300)
        assert traffic.errors() == [] and len(traffic.outcomes) >= 280, traffic.errors()[:3]
        after = status()
        assert after["controller_pid"] == by_hand.pid and after["router_pids"] == before["router_pids"]
        assert {g["name"]: [m["pid"] for m in g["members"]] for g in after["groups"]} == members

        # 7. stopping the UI leaves the controller started by hand serving, and says so
        ui.proc.send_signal(signal.SIGTERM)
        ui.proc.wait(timeout=180)
        assert "keeps serving" in ui.log_tail(40)
        assert by_hand.alive() and all(start_ticks(pid) is not None for pid in after["router_pids"])
        answer = Traffic().client.completions.create(model="default", prompt="still here", max_tokens=2)
        assert answer.choices
    finally:
        ui.stop(grace_s=90)
        if by_hand is not None:
            if by_hand.alive():
                with ControlClient.connect() as client:
                    client.down()
            by_hand.stop(grace_s=60)

