"""activate_warm, park_group, scale_to: the warm pool's verbs."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from engine.group.groupset import get_groupset
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds
from engine.scaling.pool import ScaleResult, open_pool
from tasks.retry import BACKOFF, JITTER


@task(name="activate_warm", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=120)
def activate_warm(name: str, groupset: str = "default") -> float:
    """Standby -> Ready: allocate KV on every member, then register. Returns seconds taken."""
    seconds = get_groupset(groupset).manager.groups[name].activate()
    get_run_logger().info("group %s activated in %.3fs", name, seconds)
    return seconds


@task(name="park_group", timeout_seconds=600)
def park_group(name: str, drain_s: float = 30.0, groupset: str = "default") -> float:
    """Ready -> Standby: drain, release KV, stay loaded. Not retried: a failed drain keeps serving."""
    return get_groupset(groupset).manager.groups[name].park(drain_s)


@task(name="scale_to", cache_policy=NO_CACHE, timeout_seconds=1800)
def scale_to(template: InferenceGroup, target: int, bounds: Bounds, warm_pool: int, floor: int | None = None,
             groupset: str = "default") -> ScaleResult:
    pool = open_pool(f"{groupset}/{template.name}", get_groupset(groupset).manager, template, bounds, warm_pool)
    result = pool.scale_to(target, floor)
    get_run_logger().info("scale_to %d: %d serving, %d standby, activated %s, parked %s, cold-started %s",
                          target, result.serving, result.standby, result.activated, result.parked, result.cold_started)
    return result
