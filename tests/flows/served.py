"""Helpers for tests that run the shipped deployments as users do: `tideflow ui` in its own process, flow runs
started with `prefect deployment run --watch`, each run in a process of the served UI's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from engine.runtime.process import Child, free_port, start_service
from flows.deployments import SHIPPED_PREFECT_FILE
from harness.canary import SHARED_CORES_JUDGE


def prefect_file_for_tests(directory: Path) -> Path:
    """The shipped deployments with the canary trigger's plan shortened for a laptop, and the cron schedules left
    out, so that a scheduled run cannot scale the fleet in the middle of a test."""
    shipped = yaml.safe_load(SHIPPED_PREFECT_FILE.read_text())
    for deployment in shipped["deployments"]:
        deployment.pop("schedules", None)
    (canary,) = [d for d in shipped["deployments"] if d["name"] == "canary-release"]
    canary["triggers"][0]["parameters"]["params"]["plan"] = short_plan()
    path = directory / "prefect.yaml"
    path.write_text(yaml.safe_dump(shipped, sort_keys=False))
    return path


def short_plan() -> dict:
    return {"steps": [{"percent": p, "hold_s": 3, "max_hold_s": 120} for p in (50, 100)],
            "judge": SHARED_CORES_JUDGE.model_dump(), "drain_s": 5}


def start_ui(home: Path, prefect_file: Path) -> tuple[Child, dict]:
    """`tideflow ui` on a free port; returns it and the environment a `prefect` command needs to reach it, once
    every deployment is registered."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_HOME": str(home / "prefect")}
    ui = start_service("tideflow-ui", [sys.executable, "-m", "flows.cli", "ui", "--port", str(port),  # a pipeline command
                                       "--prefect-file", str(prefect_file)],
                       home / "logs" / "ui.log", api + "/health", timeout_s=300, env=env)
    try:
        with httpx.Client(base_url=api, trust_env=False, timeout=10) as prefect:
            until(lambda: prefect.get("/deployments/name/fleet_status/fleet-status").status_code == 200, 300, ui)
    except BaseException:
        ui.stop(grace_s=90)
        raise
    return ui, {**os.environ, **env, "PREFECT_API_URL": api}


def until(check, timeout_s: float, child: Child | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert child is None or child.alive(), child.log_tail()
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.5)


def run_deployment(env: dict, name: str, params: dict | None = None, expect: str = "Completed") -> str:
    """`prefect deployment run NAME --watch`: the run happens in the served process's child, not here. Returns its
    output, once the run ended in a state named `expect`."""
    argv = [sys.executable, "-m", "prefect", "deployment", "run", name, "--watch", "--watch-timeout", "900"]
    if params is not None:
        argv += ["--param", f"params={json.dumps(params)}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=960)
    out = done.stdout + done.stderr
    assert f"Flow run finished{' successfully' if expect == 'Completed' else ''} in" in out, out[-3000:]
    assert f"{expect!r}." in out, out[-3000:]  # `prefect deployment run --watch` names the final state
    assert (done.returncode == 0) == (expect == "Completed"), out[-3000:]
    return out


def prefect_api(env: dict) -> httpx.Client:
    return httpx.Client(base_url=env["PREFECT_API_URL"], trust_env=False, timeout=30)


def flow_runs(env: dict, deployment: str) -> list[dict]:
    """The flow runs of one deployment (by its name), as Prefect's API lists them."""
    with prefect_api(env) as api:
        r = api.post("/flow_runs/filter", json={"deployments": {"name": {"any_": [deployment]}}})
        r.raise_for_status()
        return r.json()


def events(env: dict, name: str, resource_id: str) -> list[dict]:
    """Events named `name` about the resource `resource_id` that reached Prefect."""
    with prefect_api(env) as api:
        r = api.post("/events/filter", json={"filter": {"event": {"name": [name]}, "resource": {"id": [resource_id]}},
                                             "limit": 50})
        r.raise_for_status()
        return r.json()["events"]
