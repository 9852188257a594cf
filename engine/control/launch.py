"""Start a controller for this TIDEFLOW_HOME when none answers (`make run`, `tideflow ui`), and stop
only what was started here."""

from __future__ import annotations

import time

from engine.control import discovery
from engine.control.client import ControlAPIError, ControlClient
from engine.control.local_runtime import stop_recorded_fleet
from engine.runtime.paths import home
from engine.runtime.process import Child, tideflow_argv


def ensure_controller(timeout_s: float = 180.0) -> Child | None:
    """None when a controller already answers (it is someone else's: leave it running); else the
    `tideflow controller` process started now, once its API answers."""
    try:
        info = discovery.find()
    except discovery.NoController:
        info = None
    if info is not None:
        with ControlClient(info.url, info.admin_key) as client:
            if client.health():
                return None
        if info.pid is None:  # a remote controller named by TIDEFLOW_CONTROLLER_URL: never start a local one instead
            raise discovery.NoController(f"the controller at {info.url} does not answer")
    child = Child("controller", tideflow_argv("controller"), home() / "logs" / "controller.log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            raise discovery.NoController(f"`tideflow controller` exited: {child.log_tail()}")
        try:
            info = discovery.find()
        except discovery.NoController:
            info = None
        if info is not None and info.pid == child.pid:
            with ControlClient(info.url, info.admin_key) as client:
                if client.health():
                    return child
        time.sleep(0.1)
    child.stop()
    raise discovery.NoController(f"`tideflow controller` did not answer within {timeout_s:.0f}s: {child.log_tail()}")


def stop_controller(child: Child) -> str:
    """`tideflow down` for the controller `ensure_controller` started, and only for it: every group, the router,
    the controller (from the store it left when it died with nobody in its place). A controller that answers
    here now but is not `child` (started by hand, or by another command, after `child` died) is someone else's:
    it is left serving. Returns what was done, for the caller to say."""
    try:
        info = discovery.find()
    except discovery.NoController:
        info = None
    try:
        if info is not None and info.pid == child.pid and child.alive():
            try:
                with ControlClient(info.url, info.admin_key) as client:
                    client.down()
            except ControlAPIError:
                stop_recorded_fleet()
                return "stopped the fleet of the controller started here (it no longer answered)"
            deadline = time.monotonic() + 60
            while child.alive() and time.monotonic() < deadline:  # it exits by itself after `down`
                time.sleep(0.1)
            return "stopped the controller started here, its groups and its router"
        if info is not None and info.local_process_alive():
            return (f"the controller started here is gone; the one serving now (pid {info.pid}, {info.url}) was not "
                    "started here and keeps serving (`tideflow down` stops it)")
        stop_recorded_fleet()
        return "the controller started here died; stopped what it had recorded"
    finally:
        child.stop(grace_s=30)
