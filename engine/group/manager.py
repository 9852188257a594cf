"""GroupManager: brings groups up atomically, supervises them, rebuilds them whole on any failure.

A group is registered in the router only once every member is Ready. When any member fails,
the group leaves the router at once, is torn down and recreated as a unit with exponential
backoff, up to `max_restarts`; then it ends Failed with the member's error.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, Field

from engine.group.backend import Backend, BackendError, GroupHandle, MemberStatus, Phase
from engine.group.spec import InferenceGroup
from engine.router.admin import RouterAdmin
from engine.router.registry import Endpoint

log = logging.getLogger(__name__)


class GroupState(str, Enum):
    PENDING = "Pending"
    STARTING = "Starting"
    READY = "Ready"
    STANDBY = "Standby"
    DRAINING = "Draining"
    STOPPED = "Stopped"
    FAILED = "Failed"


class GroupEvent(BaseModel):
    at: float = Field(description="unix time")
    state: GroupState
    message: str = ""


class SupervisionPolicy(BaseModel):
    ready_timeout_s: float = Field(180.0, gt=0, description="members must all be Ready within this")
    max_restarts: int = Field(3, ge=0, description="rebuilds before the group is declared Failed")
    backoff_s: float = Field(0.5, ge=0, description="first rebuild delay; doubles each time")
    backoff_max_s: float = Field(30.0, ge=0, description="cap of the rebuild delay")
    poll_s: float = Field(0.1, gt=0, description="member observation period")


class GroupStatus(BaseModel):
    name: str
    version: str
    state: GroupState
    handle: GroupHandle | None = None
    restarts: int = 0
    members: list[MemberStatus] = Field(default_factory=list)
    events: list[GroupEvent] = Field(default_factory=list)
    last_ready_s: float | None = Field(None, description="seconds from start to Ready of the last (re)build")


class ManagedGroup:
    """One group's supervisor thread."""

    def __init__(self, spec: InferenceGroup, backend: Backend, router: RouterAdmin | None, policy: SupervisionPolicy,
                 state_dir: Path | None, standby: bool = False, weight: float = 1.0) -> None:
        self.spec, self.backend, self.router, self.policy = spec, backend, router, policy
        self.state_dir, self.weight = state_dir, weight
        self.status = GroupStatus(name=spec.name, version=spec.version, state=GroupState.PENDING)
        self.standby = standby
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"group-{spec.name}", daemon=True)
        self._event(GroupState.PENDING, "accepted")

    def start(self) -> "ManagedGroup":
        self._thread.start()
        return self

    # -- observation -------------------------------------------------------------------------
    def wait_for(self, states: set[GroupState], timeout_s: float) -> GroupState:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.status.state not in states and time.monotonic() < deadline:
                self._changed.wait(timeout=max(0.0, deadline - time.monotonic()))
            return self.status.state

    def _event(self, state: GroupState, message: str = "") -> None:
        with self._changed:
            self.status.state = state
            self.status.events.append(GroupEvent(at=time.time(), state=state, message=message))
            self._changed.notify_all()
        log.info("group %s: %s %s", self.spec.name, state.value, message)
        self._persist()

    def _persist(self) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_dir / f".{self.spec.name}.json.tmp"
        tmp.write_text(self.status.model_dump_json(indent=2))
        tmp.replace(self.state_dir / f"{self.spec.name}.json")

    # -- the loop ------------------------------------------------------------------------------
    def _supervise(self) -> None:
        delay = self.policy.backoff_s
        while not self._stop.is_set():
            failure = self._build_and_watch()
            if self._stop.is_set():
                break
            if self.status.restarts >= self.policy.max_restarts:
                self._event(GroupState.FAILED, f"gave up after {self.status.restarts} restarts: {failure}")
                return
            self.status.restarts += 1
            self._event(GroupState.STARTING, f"rebuilding whole group in {delay:.1f}s (restart {self.status.restarts}): {failure}")
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self.policy.backoff_max_s)

    def _build_and_watch(self) -> str:
        """Start every member, register when all are Ready, watch; returns why the group fell."""
        self._event(GroupState.STARTING, "starting members")
        t0 = time.monotonic()
        try:
            handle = self.backend.start(self.spec, standby=self.standby)
        except BackendError as exc:
            return str(exc)
        self.status.handle = handle
        try:
            failure = self._await_ready(handle)
            if failure:
                return failure
            self.status.last_ready_s = time.monotonic() - t0
            if self.standby:
                self._event(GroupState.STANDBY, f"all {self.spec.total_members} members loaded and warm ({self.status.last_ready_s:.1f}s)")
            else:
                self._register()
                self._event(GroupState.READY, f"all {self.spec.total_members} members ready ({self.status.last_ready_s:.1f}s)")
            return self._watch(handle)
        finally:
            self._unregister()
            self.backend.delete(handle)

    def _await_ready(self, handle: GroupHandle) -> str | None:
        deadline = time.monotonic() + self.policy.ready_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            members = self.backend.members(handle)
            self.status.members = members
            bad = [m for m in members if m.phase in (Phase.FAILED, Phase.EXITED)]
            if bad:
                return _describe(bad[0])
            if all(m.phase == Phase.READY for m in members):
                return None
            self._stop.wait(self.policy.poll_s)
        return "stopped" if self._stop.is_set() else f"members not ready within {self.policy.ready_timeout_s:.0f}s"

    def _watch(self, handle: GroupHandle) -> str:
        while not self._stop.wait(self.policy.poll_s):
            members = self.backend.members(handle)
            self.status.members = members
            bad = [m for m in members if m.phase in (Phase.FAILED, Phase.EXITED)]
            if bad:
                self._unregister()  # out of the router first, then everything else
                return _describe(bad[0])
        return "stopped"

    def _register(self) -> None:
        if self.router is None or self.status.handle is None:
            return
        leaders = [m for m in self.status.members if m.endpoint]
        endpoints = [Endpoint(url=m.endpoint, role=m.role, instance=m.instance) for m in leaders]
        self.router.register(self.spec.name, self.spec.version, endpoints, self.weight)

    def _unregister(self) -> None:
        if self.router is not None:
            try:
                self.router.deregister(self.spec.name)
            except Exception as exc:  # the router may be gone during shutdown; nothing to route then
                log.warning("group %s: could not deregister: %s", self.spec.name, exc)

    # -- control ----------------------------------------------------------------------------------
    def activate(self) -> None:
        """Standby -> Ready: register the already warm group."""
        if self.status.state != GroupState.STANDBY:
            raise BackendError(f"group {self.spec.name} is {self.status.state.value}, not Standby")
        self.standby = False
        self._register()
        self._event(GroupState.READY, "activated from standby")

    def drain_and_stop(self, drain_s: float = 30.0) -> None:
        """Stop new traffic, wait for in-flight requests (bounded), then stop every member."""
        if self.router is not None and self.status.state == GroupState.READY:
            self._event(GroupState.DRAINING, "weight 0, waiting for in-flight requests")
            self.router.set_weights({self.spec.name: 0.0})
            deadline = time.monotonic() + drain_s
            while self.router.inflight(self.spec.name) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=drain_s + 30)
        self._event(GroupState.STOPPED, "all members stopped")


def _describe(m: MemberStatus) -> str:
    return f"{m.role} instance {m.instance} rank {m.rank} {m.phase.value}: {m.message}".strip()


class GroupManager:
    """All groups of one group set, and the router they register with."""

    def __init__(self, backend: Backend, router: RouterAdmin | None, policy: SupervisionPolicy | None = None,
                 state_dir: Path | None = None) -> None:
        self.backend, self.router = backend, router
        self.policy = policy or SupervisionPolicy()
        self.state_dir = state_dir
        self.groups: dict[str, ManagedGroup] = {}

    def up(self, spec: InferenceGroup, standby: bool = False, weight: float = 1.0) -> ManagedGroup:
        if spec.name in self.groups and self.groups[spec.name].status.state not in (GroupState.STOPPED, GroupState.FAILED):
            raise BackendError(f"group {spec.name} is already managed ({self.groups[spec.name].status.state.value})")
        managed = ManagedGroup(spec, self.backend, self.router, self.policy, self.state_dir, standby, weight).start()
        self.groups[spec.name] = managed
        return managed

    def status(self) -> list[GroupStatus]:
        return [g.status for g in self.groups.values()]

    def shutdown(self, drain_s: float = 10.0) -> None:
        for g in list(self.groups.values()):
            if g.status.state not in (GroupState.STOPPED, GroupState.FAILED):
                g.drain_and_stop(drain_s)


def read_status_files(state_dir: Path) -> list[dict]:
    """What `tideflow group status` prints: the state files running managers keep current."""
    return [json.loads(p.read_text()) for p in sorted(state_dir.glob("*.json"))]
