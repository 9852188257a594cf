"""load_drill and fault_drill flows: drive the fleet's router and report.

Both find the fleet through the controller, so they run the same from `make run`, a nightly
schedule, the Prefect UI or CI, each in a process of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, Field

from engine.control import discovery
from engine.control.client import ControlClient
from engine.control.models import GroupView, describe_fleet
from drills.fault import FaultDrillReport, FaultDrillSpec
from drills.results import LoadDrillReport
from drills.spec import LoadDrillSpec
from engine.runtime.errors import TideflowError
from engine.group.spec import InferenceGroup
from engine.runtime.paths import home
from engine.router.registry import GROUP_NAME_PATTERN
from tasks.drills import restore_after_standby_drill, run_fault_drill, run_load_drill, start_standby_copy
from tasks.fleet import changing_fleet
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
    group: str | None = Field(None, pattern=GROUP_NAME_PATTERN,
                              description="group to hit; default: the serving group with the most traffic")
    target: str = Field("decode", description="prefill, decode, colocated, encoder, expert, router or controller")
    repeats: int = Field(1, ge=1, le=20, description="kills, one after the other, each once the group is back")
    rate: float = Field(4.0, gt=0, description="background load, req/s")
    duration_s: float = Field(4.0, gt=0, description="seconds of load per repeat")
    allow_serving: bool = Field(False, description="needed to drill a group that takes traffic: its clients' streams "
                                                   "are cut at the kill (migrated, or failed)")
    create_if_missing: bool = Field(False, description="when the fleet has no group named `group`: bring it up from "
                                                       "`spec_file` under that name for the drill, delete it afterwards")
    spec_file: Path = Field(Path("deployments/groups/tiny-pd.yaml"), description="with create_if_missing: the shape "
                                                                                 "of the group brought up")
    standby: bool = Field(False, description="drill 1 group + warm pool: a silent copy of the group is brought up "
                                             "first, takes over when the member dies, and is removed afterwards")


class DrillRefused(TideflowError):
    """The drill's parameters name no group it may hit; nothing was started or stopped."""


def drill_target(params: FaultDrillParams, groups: list[GroupView]) -> tuple[str, bool]:
    """(the group to hit, whether the drill brings it up itself). A name that is not in the fleet is an error
    listing what is, never a fallback to another group; a serving group needs `allow_serving`."""
    by_name = {g.name: g for g in groups}
    serving = sorted((g for g in groups if g.serving), key=lambda g: -g.weight)
    fleet = describe_fleet(groups)
    if params.group is None:
        if not serving:
            raise DrillRefused(f"no group serves, and `group` is unset: name the group to drill (fleet: {fleet})")
        name = serving[0].name
    elif params.group in by_name:
        name = params.group
    elif params.create_if_missing:
        return params.group, True
    else:
        raise DrillRefused(f"no group named {params.group!r}; the fleet has: {fleet}. Name one of them, or set "
                           f"create_if_missing to bring {params.group!r} up from {params.spec_file} for the drill")
    g = by_name[name]
    if g.serving and not params.allow_serving:
        raise DrillRefused(f"group {name} serves traffic (weight {g.weight:g}): set allow_serving to drill it; "
                           "its clients' open streams are cut at the kill and must migrate")
    return name, False


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
                         slo_tpot_ms=params.slo_tpot_ms, out_dir=home() / "drills" / "load-latest",
                         flow_run_id=flow_run.id)
    if params.router_url:  # another fleet's router: this controller's lease says nothing about it
        return run_load_drill(spec)
    with changing_fleet("load drill"):  # its load would skew a canary's judge, and a scale's view of the load
        return run_load_drill(spec)


@flow(name="fault_drill", log_prints=True)
def fault_drill(params: FaultDrillParams = FaultDrillParams()) -> FaultDrillReport:
    """Kills a member of a group and proves it is rebuilt whole with nothing lost. It hits only the group it is
    given (or the serving one), and deletes only a group it brought up itself (create_if_missing)."""
    with ControlClient.connect() as client:
        name, own = drill_target(params, client.status().groups)
    with changing_fleet(f"fault drill of {name}"):
        if own:
            spec = InferenceGroup.model_validate({**InferenceGroup.from_yaml(params.spec_file).model_dump(), "name": name})
            start_group(spec, weight=1.0)
            await_group_ready(name)
        else:
            with ControlClient.connect() as client:
                drilled = client.group(name)
            if not drilled.serving:
                get_run_logger().warning("drilling %s, which takes no traffic (%s, weight %g): the drill proves the "
                                         "rebuild, not that serving clients lose nothing", name, drilled.state.value,
                                         drilled.weight)
        params = params.model_copy(update={"group": name})
        warm = start_standby_copy(name) if params.standby else None
        try:
            url, key_env = fleet_router()
            load = LoadDrillSpec(url=url, model="default", api_key_env=key_env, rate=params.rate,
                                 duration_s=params.duration_s, expectations_suite=None, progress_bar=False,
                                 flow_run_id=flow_run.id)
            return run_fault_drill(FaultDrillSpec(group=name, target=params.target, repeats=params.repeats, load=load))
        finally:
            if warm is not None:
                restore_after_standby_drill(name, warm)
            if own:
                with ControlClient.connect() as client:
                    client.delete(name)
