"""Control-plane faults for the fault drill: the router (killed by the controller, which starts a new one)
and the controller itself (SIGKILLed here, then started again with its own command line, as its supervisor
would: systemd's Restart=always, a Kubernetes Deployment). Neither may cost a member: the groups keep
serving through both, and the restarted controller adopts them rather than rebuilding."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from engine.control import discovery
from engine.runtime.errors import TideflowError
from engine.runtime.http import bearer_client
from engine.runtime.paths import home
from engine.runtime.process import Child, start_ticks


class PlaneFaultError(TideflowError):
    """The control-plane fault cannot be drilled here."""


def kill_controller(confirm_s: float = 10.0) -> tuple[str, bool, list[str]]:
    """SIGKILL the controller of this TIDEFLOW_HOME: (what was killed, seen gone, its command line)."""
    info = discovery.find()
    if info.pid is None:
        raise PlaneFaultError(f"the controller at {info.url} runs elsewhere (TIDEFLOW_CONTROLLER_URL): the drill "
                              "can only kill a controller on this machine; on Kubernetes delete its pod")
    ticks = start_ticks(info.pid)
    try:
        argv = [a.decode() for a in Path(f"/proc/{info.pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError as exc:
        raise PlaneFaultError(f"cannot read the controller's command line (pid {info.pid}): {exc}") from None
    os.kill(info.pid, signal.SIGKILL)
    deadline = time.monotonic() + confirm_s
    while start_ticks(info.pid) == ticks and time.monotonic() < deadline:
        time.sleep(0.01)
    return f"pid {info.pid}", start_ticks(info.pid) != ticks, argv


def restart_controller(argv: list[str]) -> Child:
    """The same command line again, in a session of its own: it outlives the drill, like the first one."""
    return Child("controller", argv, home() / "logs" / "controller.log")


def router_answers(router_url: str) -> bool:
    """The router is up and has a routable group (its open /ready)."""
    try:
        with bearer_client(None, timeout_s=2.0) as http:
            return http.get(router_url + "/ready").status_code == 200
    except Exception:  # refused or reset while it restarts: not back yet
        return False
