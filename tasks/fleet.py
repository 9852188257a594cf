"""record_fleet: the fleet as the controller sees it, as a markdown artifact of the flow run."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from engine.control.client import ControlClient
from engine.control.models import FleetStatus
from engine.control.report import fleet_markdown
from tasks.lease import hold_fleet


@task(name="record_fleet", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2, timeout_seconds=60)
def record_fleet(title: str = "Fleet") -> FleetStatus:
    """Every run that changes the fleet ends with this, success or not: what it left is on the run's page."""
    with ControlClient.connect() as client:
        status = client.status()
    create_markdown_artifact(key="fleet-status", markdown=fleet_markdown(status, title),
                             description="the fleet after this run (tideflow status)")
    return status


@contextmanager
def changing_fleet(purpose: str) -> Iterator[None]:
    """The body of a flow that changes the fleet: it holds the fleet lease, and the run ends with the fleet's
    artifact whether it succeeded or not (a failure to draw it is logged, never hides the run's own error)."""
    with hold_fleet(purpose):
        try:
            yield
        finally:
            try:
                record_fleet(f"Fleet after {purpose}")
            except Exception as exc:  # the run's own outcome matters more than its picture
                get_run_logger().warning("fleet status not recorded: %s", exc)
