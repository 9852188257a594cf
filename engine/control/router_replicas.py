"""The local runtime's routers: N replicas of `tideflow router` on one port, each started again when it dies.

Every replica binds the port with SO_REUSEPORT, so the kernel spreads new connections over the live ones
and sends none to a replica that has died: a router SIGKILL loses only the requests that were on that
replica, and a client's next connection reaches a survivor. Replicas take the route set from the
controller (engine.router.sync), so a replica started again serves the same groups as the others without
the controller pushing anything to it.

A replica that dies is started again on the next reconcile pass, without waiting for it to answer (the
kernel sends it connections once it listens, which it does once it is set up); one that keeps dying
within `STEADY_S` of its start waits longer each time, up to `MAX_PAUSE_S`.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from engine.control.store import RouterRecord, Store
from engine.group.backend import BackendError
from engine.runtime.paths import home
from engine.runtime.process import Adopted, Child, adopt, free_port, loopback_members, tideflow_argv, wait_http_ok
from engine.runtime.tls import is_loopback

STEADY_S = 30.0  # a replica that lived this long died of something new: start it again at once
MAX_PAUSE_S = 30.0
START_TIMEOUT_S = 60.0


def plain_http(s: "RouterSettings") -> list[str]:
    """The flag a router off loopback needs to serve plain HTTP: the controller was told TLS off."""
    return ["--plain-http"] if s.scheme == "http" and not is_loopback(s.host) else []


class RouterSettings(BaseModel):
    """What every replica is started with."""

    host: str
    port: int = Field(ge=0, le=65535, description="0: the port the replicas had, else a free one")
    replicas: int = Field(ge=1, le=16)
    model_name: str
    model_dir: Path
    controller_url: str
    args: list[str] = Field(default_factory=list, description="extra `tideflow router` flags")
    env: dict[str, str] = Field(description="the replicas' keys (engine.control.local_runtime.router_env) and "
                                            "TLS identity")
    scheme: str = Field("http", pattern="^https?$", description="https: the replicas serve the fleet's certificate")


@dataclass
class _Slot:
    """One replica's process, and when a dead one may be started again."""

    proc: Child | Adopted | None = None
    started_at: float = 0.0
    pause_s: float = 0.0
    retry_at: float = 0.0


class RouterReplicas:
    """Keeps `settings.replicas` routers on one port; their records in the store let a restarted controller
    adopt them instead of replacing them (which would fail the requests they hold)."""

    def __init__(self, settings: RouterSettings, store: Store) -> None:
        self.settings, self.store = settings, store
        self.port = 0
        self._slots: dict[int, _Slot] = {}

    @property
    def url(self) -> str:
        return f"{self.settings.scheme}://{self.settings.host}:{self.port}" if self.port else ""

    def ensure(self) -> list[int]:
        """At the first call: adopt the recorded replicas that still serve this controller, start the rest and
        wait until the port answers (any replica may answer; one that dies meanwhile fails the start). Later:
        start again each replica that has died, not waiting for it. Returns the pids of the replicas found dead."""
        if not self.port:
            self._adopt()
            started = [self._start(slot) for slot in range(self.settings.replicas) if slot not in self._slots]
            for slot, child in started:
                if not wait_http_ok(self.url + "/health", timeout_s=START_TIMEOUT_S, child=child):
                    tail = child.log_tail()
                    self.stop()
                    raise RuntimeError(f"router replica {slot} did not come up within {START_TIMEOUT_S:.0f}s: {tail}")
            return []
        now, gone = time.monotonic(), []
        for slot in range(self.settings.replicas):
            state = self._slots.setdefault(slot, _Slot())
            if state.proc is not None and state.proc.alive():
                continue
            if state.proc is not None:
                lived_s = now - state.started_at
                state.pause_s = 0.0 if lived_s >= STEADY_S else min(max(2 * state.pause_s, 1.0), MAX_PAUSE_S)
                state.retry_at = now + state.pause_s
                self.store.event("router", f"router replica {slot} (pid {state.proc.pid}) gone after {lived_s:.1f}s; "
                                           + (f"starting it again in {state.pause_s:g}s" if state.pause_s
                                              else "starting it again"))
                state.proc.stop()  # reap it
                gone.append(state.proc.pid)
                state.proc = None
                self.store.set_router(slot, None)
            if now >= state.retry_at:
                self._start(slot)
        return gone

    def _adopt(self) -> None:
        """Take over each recorded replica that is the same live process, shares its port, watches this
        controller and answers; stop the others (a router from before replicas cannot share its port)."""
        records = self.store.routers()
        ports = {rec.port for rec in records.values()}
        want_port = self.settings.port or (min(ports) if ports else 0)
        for slot, rec in records.items():
            proc = adopt("router", rec.pid, rec.ticks, Path(rec.log_path))
            url = f"{self.settings.scheme}://{self.settings.host}:{rec.port}"
            if (proc is not None and slot < self.settings.replicas and rec.reuse_port and rec.port == want_port
                    and rec.controller_url == self.settings.controller_url
                    and wait_http_ok(url + "/health", timeout_s=5)):
                self._slots[slot] = _Slot(proc=proc, started_at=time.monotonic())
                self.store.event("router", f"adopted router replica {slot} pid {rec.pid} on {url}")
                continue
            if proc is not None:
                proc.stop()
                self.store.event("router", f"stopped router pid {rec.pid} on {url}: it cannot serve as replica {slot} "
                                           "of this controller")
            self.store.set_router(slot, None)
        self.port = want_port or free_port(self.settings.host)

    def _start(self, slot: int) -> tuple[int, Child]:
        s = self.settings
        argv = tideflow_argv("router", "--host", s.host, "--port", str(self.port), "--reuse-port", "--replica-port", "0",
                             "--model-name",
                             s.model_name, "--model-dir", str(s.model_dir), "--controller-url", s.controller_url,
                             *loopback_members(s.host), *plain_http(s), *s.args)
        child = Child(f"router-{slot}", argv, home() / "logs" / f"router-{self.port}-{slot}.log", s.env)
        self.store.set_router(slot, RouterRecord(pid=child.pid, ticks=child.start_ticks, port=self.port,
                                                 log_path=str(child.log_path), controller_url=s.controller_url,
                                                 reuse_port=True))
        state = self._slots.setdefault(slot, _Slot())
        state.proc, state.started_at = child, time.monotonic()
        self.store.event("router", f"started router replica {slot} pid {child.pid} on {self.url}")
        return slot, child

    def pids(self) -> list[int]:
        """The live replicas' pids, by slot."""
        return [s.proc.pid for _, s in sorted(list(self._slots.items())) if s.proc is not None and s.proc.alive()]

    def kill_one(self, confirm_s: float = 10.0) -> tuple[str, bool]:
        """SIGKILL the first live replica (a fault drill): (what was killed, whether it was seen gone)."""
        live = [(slot, s.proc) for slot, s in sorted(list(self._slots.items())) if s.proc is not None and s.proc.alive()]
        if not live:
            raise BackendError("no router replica runs: nothing to kill")
        slot, proc = live[0]
        proc.kill(signal.SIGKILL)
        deadline = time.monotonic() + confirm_s
        while proc.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"pid {proc.pid}, replica {slot} of {len(live)}", not proc.alive()

    def stop(self) -> int:
        """Stop every replica and forget their records; returns how many ran."""
        stopped = 0
        for slot, state in self._slots.items():
            if state.proc is not None and state.proc.alive():
                stopped += 1
            if state.proc is not None:
                state.proc.stop()
            self.store.set_router(slot, None)
        self._slots.clear()
        return stopped


def stop_recorded_routers(store: Store) -> int:
    """Every recorded replica that is still the same process (no controller runs); the records are cleared."""
    stopped = 0
    for slot, rec in store.routers().items():
        proc = adopt("router", rec.pid, rec.ticks, Path(rec.log_path))
        if proc is not None:
            proc.stop()
            stopped += 1
        store.set_router(slot, None)
    return stopped
