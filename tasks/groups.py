"""start_group, await_group_ready, register_group: a group comes up whole, then takes traffic."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from engine.errors import TideflowError
from engine.group.groupset import GroupSetConfig, get_groupset, open_groupset
from engine.group.manager import GroupState, GroupStatus
from engine.group.spec import InferenceGroup
from tasks.retry import BACKOFF, JITTER


class GroupNotReady(TideflowError):
    """A group ended Failed (after its own bounded restarts) or did not become Ready in time."""


@task(name="start_group", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=300)
def start_group(spec: InferenceGroup, groupset: GroupSetConfig) -> str:
    """Start every member; the manager registers the group at weight 0 once all are Ready."""
    managed = open_groupset(groupset).up(spec, weight=0.0)
    get_run_logger().info("group %s %s: starting %d members", spec.name, spec.version, spec.total_members)
    return managed.spec.name


@task(name="await_group_ready", timeout_seconds=1800)
def await_group_ready(name: str, groupset: str = "default", timeout_s: float = 600.0) -> GroupStatus:
    """No retries: the manager already rebuilds failing groups with bounded restarts."""
    managed = get_groupset(groupset).manager.groups[name]
    state = managed.wait_for({GroupState.READY, GroupState.FAILED}, timeout_s)
    status = managed.status
    create_table_artifact(key=f"group-{name}", description=f"group {name} {status.version}: {state.value}",
                          table=[{"at": e.at, "state": e.state.value, "message": e.message} for e in status.events])
    if state != GroupState.READY:
        raise GroupNotReady(f"group {name} is {state.value}: {status.events[-1].message}")
    return status


@task(name="register_group", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=60)
def register_group(name: str, weight: float, groupset: str = "default") -> dict[str, float]:
    """Open a registered group to traffic (its weight in the router)."""
    return get_groupset(groupset).admin.set_weights({name: weight})
