"""scale_to: the warm pool's one verb, carried out by the controller that owns the pool; await_pool: the run
ends only once the pool is what it asked for."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.control.client import ControlClient
from engine.control.models import GroupView, ScalePool
from engine.runtime.errors import TideflowError
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds
from engine.scaling.pool import ScaleResult

_SETTLING = (GroupState.PENDING, GroupState.STARTING)


class PoolNotReady(TideflowError):
    """The pool did not reach its target in time; the message says where each of its groups stands."""


def pool_groups(groups: list[GroupView], template: str) -> list[GroupView]:
    """The copies of `template` (named <template>-<i>, as the warm pool names them)."""
    prefix = template + "-"
    return [g for g in groups if g.name.startswith(prefix) and g.name[len(prefix):].isdigit()]


@task(name="scale_to", cache_policy=NO_CACHE, timeout_seconds=1800)
def scale_to(template: InferenceGroup, target: int, bounds: Bounds, warm_pool: int, floor: int | None = None) -> ScaleResult:
    with ControlClient.connect() as client:
        result = client.scale_pool(ScalePool(template=template, target=target, bounds=bounds, warm_pool=warm_pool,
                                             floor=floor))
    get_run_logger().info("scale_to %d: %d serving, %d standby, activated %s, parked %s, cold-started %s",
                          target, result.serving, result.standby, result.activated, result.parked, result.cold_started)
    if result.errors:
        raise PoolNotReady(f"scale_to {target}: {'; '.join(result.errors)}")
    return result


@task(name="await_pool", cache_policy=NO_CACHE, timeout_seconds=3600)
def await_pool(template: str, serving: int, timeout_s: float = 600.0, poll_s: float = 0.5) -> list[GroupView]:
    """Until exactly `serving` copies are Ready and taken by every router replica, and no copy is still starting
    (cold starts serve, refills are parked): a scale-up is only done when the capacity takes traffic."""
    logger = get_run_logger()
    deadline = time.monotonic() + timeout_s
    with ControlClient.connect() as client:
        while True:
            pool = pool_groups(client.status().groups, template)
            routable = {g["name"] for g in client.groups() if g["routable"]}
            ready = [g for g in pool if g.serving and g.name in routable]
            settling = [g.name for g in pool if g.state in _SETTLING]
            if len(ready) == serving and not settling:
                logger.info("pool %s: %d serving (%s), %d standby", template, serving, ", ".join(g.name for g in ready),
                            sum(g.state == GroupState.STANDBY for g in pool))
                return pool
            if time.monotonic() > deadline:
                where = ", ".join(g.describe() + ("" if g.name in routable else " not routed") for g in pool) or "no groups"
                raise PoolNotReady(f"pool {template} did not reach {serving} serving group(s) within {timeout_s:g}s: "
                                   f"{where}")
            time.sleep(poll_s)
