"""load_drill and fault_drill flows: drive the group set's router and report."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow
from pydantic import BaseModel, Field

from engine.drills.fault import FaultDrillReport, FaultDrillSpec
from engine.drills.results import LoadDrillReport
from engine.drills.spec import LoadDrillSpec
from engine.default_model import write_default_model
from engine.group.groupset import GroupSetConfig, close_groupsets, get_groupset
from engine.group.spec import InferenceGroup
from engine.paths import home
from tasks.drills import run_fault_drill, run_load_drill
from tasks.groups import await_group_ready, start_group

DRILL_KEY_ENV = "TIDEFLOW_DRILL_API_KEY"


class LoadDrillParams(BaseModel):
    steps: list[float] = Field([1.0, 2.0, 4.0, 8.0], description="offered rates (req/s), rising")
    hold_s: float = Field(5.0, gt=0, description="seconds per step")
    prompt_len: str = Field("uniform:16:64", description="prompt length law")
    output_len: str = Field("fixed:32", description="max_tokens law")
    slo_ttft_ms: float = Field(2000.0, gt=0)
    slo_tpot_ms: float = Field(500.0, gt=0)
    groupset: str = Field("default", description="group set of this process whose router is drilled")
    router_url: str | None = Field(None, description="drill this router instead (e.g. a cluster's)")
    api_key_env: str | None = Field(None, description="env var holding router_url's API key")


class FaultDrillParams(BaseModel):
    group: str = Field("tiny-pd", description="group to hit")
    target: str = Field("decode", description="prefill | decode | colocated | encoder | expert")
    repeats: int = Field(1, ge=1, le=20)
    rate: float = Field(4.0, gt=0, description="background load, req/s")
    duration_s: float = Field(4.0, gt=0, description="seconds of load per repeat")
    groupset: str = Field("default")
    spec_file: Path = Field(Path("deployments/groups/tiny-pd.yaml"),
                            description="group to bring up for the drill when this process runs none")


def _router(gs) -> tuple[str, str]:
    """The router URL, with its client key exported under a name the drill spec can carry (never the key)."""
    os.environ[DRILL_KEY_ENV] = gs.client_key
    return gs.url, DRILL_KEY_ENV


@flow(name="load_drill", log_prints=True)
def load_drill(params: LoadDrillParams = LoadDrillParams()) -> LoadDrillReport:
    url, key_env = (params.router_url, params.api_key_env) if params.router_url else _router(get_groupset(params.groupset))
    spec = LoadDrillSpec(url=url, model="default", api_key_env=key_env, steps=params.steps, hold_s=params.hold_s,
                         prompt_len=params.prompt_len, output_len=params.output_len, slo_ttft_ms=params.slo_ttft_ms,
                         slo_tpot_ms=params.slo_tpot_ms, out_dir=home() / "drills" / "load-latest")
    return run_load_drill(spec)


@flow(name="fault_drill", log_prints=True)
def fault_drill(params: FaultDrillParams = FaultDrillParams()) -> FaultDrillReport:
    """Kills members of a group this process runs; with none running (a nightly schedule), it first brings
    `spec_file` up in its own group set and stops it afterwards."""
    try:
        gs, own = get_groupset(params.groupset), False
    except KeyError:
        spec = InferenceGroup.from_yaml(params.spec_file)
        model_dir = Path(spec.model.expanded_path())
        if not (model_dir / "config.json").exists():
            write_default_model(model_dir)
        start_group(spec, GroupSetConfig(name=params.groupset, model_dir=model_dir))
        await_group_ready(spec.name, params.groupset)
        gs, own, params = get_groupset(params.groupset), True, params.model_copy(update={"group": spec.name})
    try:
        url, key_env = _router(gs)
        load = LoadDrillSpec(url=url, model="default", api_key_env=key_env, rate=params.rate,
                             duration_s=params.duration_s, expectations_suite=None, progress_bar=False)
        return run_fault_drill(FaultDrillSpec(group=params.group, target=params.target, repeats=params.repeats,
                                              load=load), params.groupset)
    finally:
        if own:
            close_groupsets()
