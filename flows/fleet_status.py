"""fleet_status: `tideflow status` on demand in the Prefect UI, as the run's markdown artifact."""

from __future__ import annotations

from prefect import flow

from engine.control.models import FleetStatus
from tasks.fleet import record_fleet


@flow(name="fleet_status", log_prints=True)
def fleet_status() -> FleetStatus:
    """Changes nothing: groups, states, weights, traffic shares, members, the latest canary and who holds the fleet."""
    return record_fleet("Fleet now")
