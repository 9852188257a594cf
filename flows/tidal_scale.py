"""tidal_scale (cron: morning up, night down) and autoscaler (the metric + schedule policy, kept running
by the controller). Both act on the controller's warm pool, whichever process runs them."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from engine.control.client import ControlClient
from engine.control.models import AutoscalerView
from engine.runtime.errors import TideflowError
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds, ScalingPolicy
from engine.scaling.pool import ScaleResult
from tasks.fleet import changing_fleet
from tasks.scaling import await_pool, pool_groups, scale_to


class TidalParams(BaseModel):
    target: int = Field(2, ge=0, description="serving groups wanted")
    floor: int | None = Field(None, ge=0, description="lower the floor below bounds.min_groups (e.g. at night)")
    spec_file: Path = Field(Path("deployments/groups/tiny-colocated.yaml"), description="template of the pool's groups")
    bounds: Bounds = Field(default_factory=Bounds, description="never fewer or more serving groups than these")
    warm_pool: int = Field(1, ge=0, description="standby groups kept loaded and warm")
    confirm: bool = Field(False, description="needed to scale a pool that serves traffic down to 0 groups")
    ready_timeout_s: float = Field(600.0, gt=0, description="the run fails unless the pool has reached its target "
                                                            "(serving groups Ready and routed, refills parked) by then")


class ScaleRefused(TideflowError):
    """A scale that would take serving capacity away without `confirm`; nothing was changed."""


@flow(name="tidal_scale", log_prints=True)
def tidal_scale(params: TidalParams = TidalParams()) -> ScaleResult:
    """Scale the fleet's pool of `spec_file` copies to `target` serving groups, standby groups first; the run
    ends once the pool is there (or fails at `ready_timeout_s`, the fleet's state in its artifact)."""
    template = InferenceGroup.from_yaml(params.spec_file)
    with changing_fleet(f"tidal scale of pool {template.name} to {params.target}"):
        if params.target == 0 and not params.confirm:
            with ControlClient.connect() as client:
                serving = [g.name for g in pool_groups(client.status().groups, template.name)
                           if g.serving]
            if serving:
                raise ScaleRefused(f"pool {template.name} serves traffic ({', '.join(serving)}): scaling it to 0 "
                                   "takes that capacity away; set confirm to do it")
        result = scale_to(template, params.target, params.bounds, params.warm_pool, params.floor)
        await_pool(template.name, result.target, params.ready_timeout_s)
    return result


class AutoscalerParams(BaseModel):
    spec_file: Path = Field(Path("deployments/groups/tiny-colocated.yaml"))
    policy: ScalingPolicy = Field(default_factory=ScalingPolicy)
    run_for_s: float | None = Field(None, gt=0, description="stop the policy after this long (None: it keeps "
                                                              "running in the controller after this run ends)")


@flow(name="autoscaler", log_prints=True)
def autoscaler(params: AutoscalerParams = AutoscalerParams()) -> AutoscalerView:
    """Start the policy in the controller (durable: it survives this run and a controller restart); with
    `run_for_s`, watch it that long, then stop it. Returns what it decided."""
    template = InferenceGroup.from_yaml(params.spec_file)
    logger = get_run_logger()
    with ControlClient.connect() as client:
        view = client.start_autoscaler(template, params.policy)
        logger.info("autoscaler over pool %s started (tick %gs)", view.name, params.policy.tick_s)
        if params.run_for_s is None:
            return view
        time.sleep(params.run_for_s)
        view = client.autoscaler(view.name)
        client.stop_autoscaler(view.name)
    for event in view.last:
        logger.info("autoscaler: %s", event)
    return view
