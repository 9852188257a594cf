"""tidal_scale (cron: morning up, night down) and autoscaler (long-running, metric + schedule policy)."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from engine.group.groupset import GroupSetConfig, get_groupset, open_groupset
from engine.group.spec import InferenceGroup
from engine.scaling.autoscaler import Autoscaler
from engine.scaling.observe import SetObserver
from engine.scaling.policy import Bounds, ScalingPolicy
from engine.scaling.pool import ScaleResult, open_pool
from tasks.scaling import scale_to


class TidalParams(BaseModel):
    target: int = Field(2, ge=0, description="serving groups wanted")
    floor: int | None = Field(None, ge=0, description="lower the floor below bounds.min_groups (e.g. at night)")
    spec_file: Path = Field(Path("deployments/groups/tiny-colocated.yaml"), description="template of the pool's groups")
    bounds: Bounds = Field(default_factory=Bounds)
    warm_pool: int = Field(1, ge=0, description="standby groups kept loaded and warm")
    groupset: str = Field("default")


def _template_and_set(spec_file: Path, groupset: str) -> InferenceGroup:
    spec = InferenceGroup.from_yaml(spec_file)
    try:
        get_groupset(groupset)
    except KeyError:
        open_groupset(GroupSetConfig(name=groupset, model_dir=Path(spec.model.expanded_path())))
    return spec


@flow(name="tidal_scale", log_prints=True)
def tidal_scale(params: TidalParams = TidalParams()) -> ScaleResult:
    """Scale this worker's pool to `target` serving groups, standby groups first."""
    template = _template_and_set(params.spec_file, params.groupset)
    return scale_to(template, params.target, params.bounds, params.warm_pool, params.floor, params.groupset)


class AutoscalerParams(BaseModel):
    spec_file: Path = Field(Path("deployments/groups/tiny-colocated.yaml"))
    policy: ScalingPolicy = Field(default_factory=ScalingPolicy)
    run_for_s: float | None = Field(None, gt=0, description="stop after this long (None = until cancelled)")
    groupset: str = Field("default")


@flow(name="autoscaler", log_prints=True)
def autoscaler(params: AutoscalerParams = AutoscalerParams()) -> int:
    """Long-running: one decision per tick; returns the number of scaling decisions taken."""
    template = _template_and_set(params.spec_file, params.groupset)
    gs = get_groupset(params.groupset)
    pool = open_pool(f"{params.groupset}/{template.name}", gs.manager, template, params.policy.bounds,
                     params.policy.warm_pool)
    observer = SetObserver(gs.url, gs.client_key, gs.member_key,
                           lambda: [m.endpoint for g in pool.serving() for m in g.status.members if m.endpoint])
    scaler = Autoscaler(pool, params.policy, observe=observer if params.policy.metrics else None).start()
    logger = get_run_logger()
    seen = 0
    deadline = None if params.run_for_s is None else time.monotonic() + params.run_for_s
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(params.policy.tick_s)
            for event in scaler.events[seen:]:
                logger.info("autoscaler: %s", event.model_dump_json())
            seen = len(scaler.events)
    finally:
        scaler.stop()
        observer.close()
    return sum(1 for e in scaler.events if e.result is not None)
