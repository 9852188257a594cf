"""scale_to: the warm pool's one verb, carried out by the controller that owns the pool."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.control.client import ControlClient
from engine.control.models import ScalePool
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds
from engine.scaling.pool import ScaleResult


@task(name="scale_to", cache_policy=NO_CACHE, timeout_seconds=1800)
def scale_to(template: InferenceGroup, target: int, bounds: Bounds, warm_pool: int, floor: int | None = None) -> ScaleResult:
    with ControlClient.connect() as client:
        result = client.scale_pool(ScalePool(template=template, target=target, bounds=bounds, warm_pool=warm_pool,
                                             floor=floor))
    get_run_logger().info("scale_to %d: %d serving, %d standby, activated %s, parked %s, cold-started %s",
                          target, result.serving, result.standby, result.activated, result.parked, result.cold_started)
    return result
