"""load_drill and fault_drill flows: drive the fleet's router and report.

Both find the fleet through the controller, so they run the same from `make run`, a nightly
schedule, the Prefect UI or CI, each in a process of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, Field

from engine.control import discovery
from engine.control.client import ControlClient
from engine.drills.fault import FaultDrillReport, FaultDrillSpec
from engine.drills.results import LoadDrillReport
from engine.drills.spec import LoadDrillSpec
from engine.group.spec import InferenceGroup
from engine.paths import home
from tasks.drills import restore_after_standby_drill, run_fault_drill, run_load_drill, start_standby_copy
from tasks.groups import await_group_ready, start_group

DRILL_KEY_ENV = "TIDEFLOW_DRILL_API_KEY"


class LoadDrillParams(BaseModel):
    steps: list[float] = Field([1.0, 2.0, 4.0, 8.0], description="offered rates (req/s), rising")
    hold_s: float = Field(5.0, gt=0, description="seconds per step")
    prompt_len: str = Field("uniform:16:64", description="prompt length law")
    output_len: str = Field("fixed:32", description="max_tokens law")
    slo_ttft_ms: float = Field(2000.0, gt=0)
    slo_tpot_ms: float = Field(500.0, gt=0)
    router_url: str | None = Field(None, description="drill this router instead of the controller's (e.g. a cluster's)")
    api_key_env: str | None = Field(None, description="env var holding router_url's API key")


class FaultDrillParams(BaseModel):
    group: str = Field("tiny-pd", description="group to hit")
    target: str = Field("decode", description="prefill | decode | colocated | encoder | expert | router | controller")
    repeats: int = Field(1, ge=1, le=20)
    rate: float = Field(4.0, gt=0, description="background load, req/s")
    duration_s: float = Field(4.0, gt=0, description="seconds of load per repeat")
    spec_file: Path = Field(Path("deployments/groups/tiny-pd.yaml"),
                            description="group to bring up for the drill when the fleet has no `group`")
    standby: bool = Field(False, description="drill 1 group + warm pool: a silent copy of the group is brought up "
                                             "first, takes over when the member dies, and is removed afterwards")


def fleet_router() -> tuple[str, str]:
    """The controller's router URL, with its client key exported under a name a drill spec can carry
    (the spec names the variable, never the key)."""
    with ControlClient.connect() as client:
        url = client.status().router_url
    os.environ[DRILL_KEY_ENV] = discovery.router_key()
    return url, DRILL_KEY_ENV


@flow(name="load_drill", log_prints=True)
def load_drill(params: LoadDrillParams = LoadDrillParams()) -> LoadDrillReport:
    url, key_env = (params.router_url, params.api_key_env) if params.router_url else fleet_router()
    spec = LoadDrillSpec(url=url, model="default", api_key_env=key_env, steps=params.steps, hold_s=params.hold_s,
                         prompt_len=params.prompt_len, output_len=params.output_len, slo_ttft_ms=params.slo_ttft_ms,
                         slo_tpot_ms=params.slo_tpot_ms, out_dir=home() / "drills" / "load-latest")
    return run_load_drill(spec)


@flow(name="fault_drill", log_prints=True)
def fault_drill(params: FaultDrillParams = FaultDrillParams()) -> FaultDrillReport:
    """Kills a member of a serving group; when the fleet has no such group (a nightly drill on a fresh
    machine) it first brings `spec_file` up and deletes it afterwards."""
    with ControlClient.connect() as client:
        own = params.group not in {g.name for g in client.status().groups}
    if own:
        spec = InferenceGroup.from_yaml(params.spec_file)
        start_group(spec, weight=1.0)
        await_group_ready(spec.name)
        params = params.model_copy(update={"group": spec.name})
    warm = start_standby_copy(params.group) if params.standby else None
    try:
        url, key_env = fleet_router()
        load = LoadDrillSpec(url=url, model="default", api_key_env=key_env, rate=params.rate,
                             duration_s=params.duration_s, expectations_suite=None, progress_bar=False)
        return run_fault_drill(FaultDrillSpec(group=params.group, target=params.target, repeats=params.repeats,
                                              load=load))
    finally:
        if warm is not None:
            restore_after_standby_drill(params.group, warm)
        if own:
            with ControlClient.connect() as client:
                client.delete(params.group)
