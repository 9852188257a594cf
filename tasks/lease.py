"""hold_fleet: the controller's fleet lease around a flow run that changes the fleet, so two such runs (a
release and a triggered canary, two crons, a drill and a canary) never act on the fleet at once.

The lease lives in the controller, not in Prefect: it holds for runs from the UI, crons, triggers, CI and
`tideflow release` alike, whichever Prefect server (or none) they report to, and across a controller restart.
A subflow of the run that holds it (release -> canary_release) holds it too.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from prefect.runtime import flow_run

from engine.control.client import ControlAPIError, ControlClient
from engine.runtime.errors import TideflowError

log = logging.getLogger(__name__)  # the renewer runs outside the flow run's context
_holder: ContextVar[str | None] = ContextVar("tideflow_fleet_holder", default=None)


class FleetBusy(TideflowError):
    """Another flow run holds the fleet; the message names it and what it changes."""


def run_holder() -> str:
    """This flow run, as the controller shows it to whoever is refused: `<run name> <run id>`."""
    if flow_run.id:
        return f"{flow_run.name} {flow_run.id}"
    return f"pid {os.getpid()}"


@contextmanager
def hold_fleet(purpose: str, ttl_s: float = 120.0) -> Iterator[str]:
    """Hold the fleet lease for the block (renewed every ttl_s/3); refused at once with FleetBusy while another
    run holds it: a change that waits silently behind another could act on a fleet it no longer knows."""
    held = _holder.get()
    if held is not None:
        yield held
        return
    holder = run_holder()
    try:
        with ControlClient.connect() as client:
            client.acquire_lease(holder, purpose, ttl_s)
    except ControlAPIError as exc:
        if exc.status == 409:
            raise FleetBusy(f"{purpose}: refused, {exc}") from None
        raise
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(holder, purpose, ttl_s, stop), name="fleet-lease", daemon=True)
    renewer.start()
    token = _holder.set(holder)
    try:
        yield holder
    finally:
        _holder.reset(token)
        stop.set()
        renewer.join(timeout=30)
        with ControlClient.connect() as client:
            client.release_lease(holder)


def _renew(holder: str, purpose: str, ttl_s: float, stop: threading.Event) -> None:
    while not stop.wait(ttl_s / 3):
        try:
            with ControlClient.connect() as client:
                client.acquire_lease(holder, purpose, ttl_s)
        except TideflowError as exc:  # a controller restart: the next renewal gets through
            log.warning("fleet lease not renewed: %s", exc)
