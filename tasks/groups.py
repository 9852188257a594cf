"""start_group, await_group_ready, register_group: a group comes up whole, then takes traffic.

Every verb goes to the controller (found through $TIDEFLOW_CONTROLLER_URL or $TIDEFLOW_HOME), so a
flow run in any process (UI, cron, trigger, CI) acts on the fleet that serves, and keeps none of it.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from engine.control.client import ControlClient
from engine.control.models import GroupView
from engine.runtime.errors import TideflowError
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from tasks.retry import BACKOFF, JITTER


class GroupNotReady(TideflowError):
    """A group ended Failed (after its own bounded restarts) or did not become Ready in time."""


@task(name="start_group", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=300)
def start_group(spec: InferenceGroup, weight: float = 0.0) -> str:
    """Desired state to the controller: the group starts, and is registered at `weight` once all are Ready."""
    with ControlClient.connect() as client:
        client.apply(spec, weight=weight)
    get_run_logger().info("group %s %s: starting %d members", spec.name, spec.version, spec.total_members)
    return spec.name


@task(name="await_group_ready", timeout_seconds=1800)
def await_group_ready(name: str, timeout_s: float = 600.0) -> GroupView:
    """No retries: the controller already rebuilds failing groups with bounded restarts."""
    with ControlClient.connect() as client:
        view = client.wait_for(name, {GroupState.READY, GroupState.FAILED}, timeout_s)
        events = [e for e in client.events(500) if name in e.message]
    create_table_artifact(key=f"group-{name}", description=f"group {name} {view.version}: {view.state.value}",
                          table=[{"at": e.at, "kind": e.kind, "message": e.message} for e in events]
                          + [{"at": None, "kind": "state", "message": f"{view.state.value}: {view.message}"}])
    if view.state != GroupState.READY:
        raise GroupNotReady(f"group {name} is {view.state.value}: {view.message}")
    return view


@task(name="register_group", retries=2, retry_delay_seconds=BACKOFF, retry_jitter_factor=JITTER, timeout_seconds=60)
def register_group(name: str, weight: float) -> dict[str, float]:
    """Open a registered group to traffic (its weight in the router, kept as desired state)."""
    with ControlClient.connect() as client:
        return client.set_weights({name: weight})
