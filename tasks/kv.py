"""kv_expiry, kv_gc, kv_remove_version: the release pipeline's hold on the shared KV store (engine.kvtier.expiry).

The stores and their TTLs come from the groups' own specs (roles[].engine.kv_tiers), as the controller reports them,
so a sweep covers exactly the stores the fleet writes to.
"""

from __future__ import annotations

import math

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from engine.control.client import ControlClient
from engine.control.models import GroupView
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.kvtier.expiry import StoreSweep, remove_version, sweep
from tasks.retry import BACKOFF, JITTER, retry_unless_permanent


def kv_stores(specs: list[InferenceGroup]) -> dict[str, float]:
    """The shared KV stores these groups' members use, each with the shortest TTL any of them asks for."""
    stores: dict[str, float] = {}
    for spec in specs:
        for role in spec.roles:
            tiers = role.engine.kv_tiers
            if tiers is not None and tiers.store_url:
                stores[tiers.store_url] = min(stores.get(tiers.store_url, math.inf), tiers.store_ttl_s)
    return stores


def fleet_groups() -> list[GroupView]:
    """The controller's groups that report their spec."""
    with ControlClient.connect() as client:
        return [g for g in client.status().groups if g.spec is not None]


def _report(key: str, title: str, sweeps: list[StoreSweep]) -> None:
    create_table_artifact(key=key, description=title, table=[s.model_dump() for s in sweeps])
    for s in sweeps:
        get_run_logger().info("%s: %s", s.url, "expires by its lifecycle rule" if s.lifecycle else
                              f"{s.objects_deleted} objects, {s.bytes_freed} bytes freed")


@task(name="kv_expiry", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_unless_permanent, timeout_seconds=600)
def kv_expiry(spec: InferenceGroup) -> list[StoreSweep]:
    """A group about to write to a store: the store's lifecycle rule expires its KV (an S3 bucket), or, where the
    store has no rules, what expired is swept now and by the kv-gc deployment afterwards."""
    sweeps = [sweep(url, ttl) for url, ttl in kv_stores([spec]).items()]
    if sweeps:
        _report("kv-expiry", f"KV stores of group {spec.name}", sweeps)
    return sweeps


@task(name="kv_gc", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_unless_permanent, timeout_seconds=3600)
def kv_gc(extra_stores: dict[str, float] | None = None) -> list[StoreSweep]:
    """Every store the fleet's groups use (and `extra_stores`, url -> TTL seconds): expired blocks deleted where
    the store has no lifecycle rule, the rule confirmed where it has."""
    stores = {**kv_stores([g.spec for g in fleet_groups()]), **(extra_stores or {})}
    sweeps = [sweep(url, ttl) for url, ttl in sorted(stores.items())]
    _report("kv-gc", f"KV stores swept: {len(sweeps)}", sweeps)
    return sweeps


@task(name="kv_remove_version", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER,
      retry_condition_fn=retry_unless_permanent, timeout_seconds=3600)
def kv_remove_version(spec: InferenceGroup, model: str = "default") -> list[StoreSweep]:
    """The blocks of a version no group serves any more (rolled back, or retired by a promotion); kept while another
    group of the fleet still runs that version (a pool group of it shares them)."""
    stores = kv_stores([spec])
    if not stores:
        return []
    others = [g.name for g in fleet_groups()
              if g.version == spec.version and g.name != spec.name and g.state != GroupState.STOPPED]
    if others:
        get_run_logger().info("KV of %s kept: %s still run it", spec.version, ", ".join(others))
        return []
    sweeps = [remove_version(url, model, spec.version) for url in stores]
    if sweeps:
        _report("kv-removed", f"KV of {spec.name} {spec.version} removed", sweeps)
    return sweeps
