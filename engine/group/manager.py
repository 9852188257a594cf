"""GroupManager: brings groups up atomically, supervises them, rebuilds them whole on any failure.

A group is registered in the router only once every member is Ready. When any member fails,
the group leaves the router at once, is torn down and recreated as a unit with exponential
backoff, up to `max_restarts`; then it ends Failed with the member's error.
"""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Callable, Protocol

from pydantic import BaseModel, Field

from engine.runtime.errors import EXIT_PEER_LOST, EXIT_WEIGHTS, TideflowError
from engine.runtime.http import Key
from engine.group.backend import Backend, BackendError, GroupHandle, MemberStatus, Phase
from engine.group.spec import InferenceGroup
from engine.router.admin import wait_drained
from engine.router.registry import Endpoint
from engine.group.switch import MemberSwitch, MemberSwitchError

log = logging.getLogger(__name__)



class Routing(Protocol):
    """Where a group is registered once Ready: a standalone router's admin API (RouterAdmin), or the
    controller's route set that every router replica watches (engine/control/routes.py)."""

    def register(self, name: str, version: str, endpoints: list[Endpoint], weight: float = 1.0) -> None: ...

    def deregister(self, name: str) -> None: ...

    def set_weights(self, weights: dict[str, float]) -> dict[str, float]: ...

    def inflight(self, name: str) -> int: ...

# Why a member ended, from its exit status (engine.runtime.errors): what the lifecycle board and the alerts count.
# "drill": a fault drill killed it on purpose (Controller.kill_member), counted apart from real failures.
FAILURE_REASONS = ("weights", "peer_lost", "killed", "failed", "drill")


def failure_reason(member: MemberStatus) -> str:
    code = member.exit_code
    if code == EXIT_WEIGHTS:
        return "weights"
    if code == EXIT_PEER_LOST:
        return "peer_lost"
    if code is not None and (code < 0 or code in (128 + 9, 128 + 15)):
        return "killed"
    return "failed"


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
    reset_after_s: float = Field(300.0, ge=0, description="Ready this long before falling: restarts and backoff start over")
    unready_s: float = Field(3.0, gt=0, description="a member of a Ready (or Standby) group seen not Ready this long "
                             "(a stopped process, a hung step, a lost network: it answers /ready no more) counts as "
                             "failed: the group leaves routing and is rebuilt whole")
    failed_retry_max_s: float = Field(600.0, gt=0, description="a Failed group that is still desired is built again "
                                      "after backoff_max_s, doubling each time up to this")


class GroupStatus(BaseModel):
    name: str
    version: str
    state: GroupState
    handle: GroupHandle | None = None
    restarts: int = 0
    members: list[MemberStatus] = Field(default_factory=list)
    events: list[GroupEvent] = Field(default_factory=list)
    last_ready_s: float | None = Field(None, description="seconds from start to Ready of the last (re)build")
    last_activation_s: float | None = Field(None, description="seconds of the last Standby -> Ready activation")
    rebuilds: int = Field(0, description="whole-group rebuilds since this controller took the group (never reset), "
                                         "fault drills' left out")
    drill_rebuilds: int = Field(0, description="whole-group rebuilds after a fault drill killed a member: never "
                                               "counted in restarts (the crash-loop budget) nor in rebuilds")
    falls: int = Field(0, description="times the group fell out of routing while serving")
    member_failures: dict[str, int] = Field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0),
                                            description="member failures that ended a build or a watch, by reason")


class ManagedGroup:
    """One group's supervisor thread."""

    def __init__(self, spec: InferenceGroup, backend: Backend, router: Routing | None, policy: SupervisionPolicy,
                 standby: bool = False, weight: float = 1.0,
                 switch: MemberSwitch | None = None, adopted: GroupHandle | None = None) -> None:
        self.spec, self.backend, self.router, self.policy = spec, backend, router, policy
        self.switch = switch  # flips members between serving and standby; None: members start serving
        self._control = threading.Lock()  # one activate or park at a time
        self.weight = weight
        self.status = GroupStatus(name=spec.name, version=spec.version, state=GroupState.PENDING)
        self.standby = standby
        self._adopted = adopted  # members an earlier controller started, watched instead of started
        self.on_fall: Callable[[ManagedGroup, str], None] | None = None  # called when a serving group falls
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._ready_since: float | None = None
        self._drill_targets: set[tuple[str, int, int]] = set()  # (role, instance, rank) a drill is killing
        self._drill_fall = False  # the last fall was a drill's kill
        self._drill_lock = threading.Lock()
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

    # -- the loop ------------------------------------------------------------------------------
    def _supervise(self) -> None:
        delay = self.policy.backoff_s
        while not self._stop.is_set():
            try:
                failure = self._build_and_watch()
            except Exception as exc:  # a dead supervisor would leave the group Starting (or Ready) forever
                log.exception("group %s: supervision failed", self.spec.name)
                failure = f"supervision failed: {exc.__class__.__name__}: {exc}"
            if self._stop.is_set():
                break
            if self._drill_fall:  # a drill's kill, not a crash: the group is rebuilt without spending its budget
                self._drill_fall = False
                self.status.drill_rebuilds += 1
                self._event(GroupState.STARTING, f"rebuilding whole group after a fault drill's kill (not counted "
                                                 f"against max_restarts): {failure}")
                if self._stop.wait(self.policy.backoff_s):
                    break
                continue
            if self._ready_since is not None and time.monotonic() - self._ready_since >= self.policy.reset_after_s:
                self.status.restarts, delay = 0, self.policy.backoff_s  # it was healthy: a new failure, not a crash loop
            if self.status.restarts >= self.policy.max_restarts:
                self._event(GroupState.FAILED, f"gave up after {self.status.restarts} restarts: {failure}")
                return
            self.status.restarts += 1
            self.status.rebuilds += 1
            self._event(GroupState.STARTING, f"rebuilding whole group in {delay:.1f}s (restart {self.status.restarts}): {failure}")
            if self._stop.wait(delay):
                break
            delay = min(delay * 2, self.policy.backoff_max_s)

    def _build_and_watch(self) -> str:
        """Start every member, register when all are Ready, watch; returns why the group fell."""
        self._ready_since = None
        with self._drill_lock:
            self._drill_targets.clear()  # a drill aims at one build: a new build's members are none of its
        t0 = time.monotonic()
        if self._adopted is not None:
            handle, self._adopted = self._adopted, None
            self._event(GroupState.STARTING, f"adopted {self.spec.total_members} running members")
        else:
            self._event(GroupState.STARTING, "starting members")
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
            self._ready_since = time.monotonic()
            failure = self._match_members(handle)
            if failure:
                return failure
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
                self._count_failure(bad[0])
                return _describe(bad[0])
            if all(m.phase == Phase.READY for m in members):
                return None
            self._stop.wait(self.policy.poll_s)
        return "stopped" if self._stop.is_set() else f"members not ready within {self.policy.ready_timeout_s:.0f}s"

    def _watch(self, handle: GroupHandle) -> str:
        unready_since: dict[tuple[str, int, int], float] = {}
        while not self._stop.wait(self.policy.poll_s):
            members = self.backend.members(handle)
            self.status.members = members
            bad = [m for m in members if m.phase in (Phase.FAILED, Phase.EXITED)] or \
                self._unready(members, unready_since)
            if bad:
                self._unregister()  # out of the router first, then everything else
                with self._drill_lock:
                    drilled = {(m.role, m.instance, m.rank) for m in bad} & self._drill_targets
                    self._drill_targets.clear()
                self._drill_fall = bool(drilled)
                if drilled:
                    self.status.member_failures["drill"] = self.status.member_failures.get("drill", 0) + 1
                else:
                    self._count_failure(bad[0])
                    if not self.standby:
                        self.status.falls += 1
                why = _describe(bad[0])
                self._event(GroupState.STARTING, f"a member failed: {why}")  # never shown Ready (or Standby) while down
                if not self.standby and self.on_fall is not None:
                    try:
                        self.on_fall(self, why)  # e.g. a standby of the same version takes the traffic now
                    except Exception:  # a failed replacement must not stop this group's own rebuild
                        log.exception("group %s: replacement after a fall failed", self.spec.name)
                return why
        return "stopped"

    def expect_drill_kill(self, role: str, instance: int, rank: int) -> None:
        """A fault drill is about to kill this member: its fall is the drill's, not a crash (forget_drill_kill
        when the kill did not go through)."""
        with self._drill_lock:
            self._drill_targets.add((role, instance, rank))

    def forget_drill_kill(self, role: str, instance: int, rank: int) -> None:
        with self._drill_lock:
            self._drill_targets.discard((role, instance, rank))

    def _unready(self, members: list[MemberStatus], since: dict[tuple[str, int, int], float]) -> list[MemberStatus]:
        """Members not Ready for policy.unready_s in a row, as failed (Failed phase, the reason in the message).
        Not while the group is being parked or activated: its members answer 503 on /ready then, on purpose."""
        if self.status.state not in (GroupState.READY, GroupState.STANDBY) or self._control.locked():
            since.clear()
            return []
        now, out = time.monotonic(), []
        for m in members:
            place = (m.role, m.instance, m.rank)
            if m.phase == Phase.READY:
                since.pop(place, None)
            elif now - since.setdefault(place, now) >= self.policy.unready_s:
                out.append(m.model_copy(update={"phase": Phase.FAILED, "message": (
                    f"not Ready for {now - since[place]:.1f}s (stopped, stuck or unreachable): {m.message}").strip()}))
        return out

    def _count_failure(self, member: MemberStatus) -> None:
        reason = failure_reason(member)
        self.status.member_failures[reason] = self.status.member_failures.get(reason, 0) + 1

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
    def activate(self) -> float:
        """Standby -> Ready: every member allocates its KV cache (all in parallel), then the group is registered.

        Returns the activation time in seconds, also kept in `status.last_activation_s`.
        """
        with self._control:
            if self.status.state != GroupState.STANDBY:
                raise BackendError(f"group {self.spec.name} is {self.status.state.value}, not Standby")
            t0 = time.monotonic()
            if self.switch is not None:
                try:
                    self.switch.activate(self._member_urls())
                except MemberSwitchError as exc:
                    raise BackendError(f"group {self.spec.name}: activation failed, still Standby: {exc}") from None
            self.standby = False
            self._register()
            took = self.status.last_activation_s = time.monotonic() - t0
            self._event(GroupState.READY, f"activated from standby ({took * 1000:.0f} ms)")
            return took

    def park(self, drain_s: float = 30.0) -> float:
        """Ready -> Standby: weight 0, wait for the router's in-flight requests, deregister, then every
        member drains and releases its KV cache (weights stay loaded). Returns the seconds it took.

        A member that cannot drain within `drain_s` keeps serving and the group is registered again:
        parking never cuts a request off.
        """
        with self._control:
            if self.status.state != GroupState.READY:
                raise BackendError(f"group {self.spec.name} is {self.status.state.value}, not Ready")
            t0 = time.monotonic()
            deadline = t0 + drain_s
            self._event(GroupState.DRAINING, "parking: weight 0, waiting for in-flight requests")
            if self.router is not None:
                self._drain(deadline)
                self._unregister()
            if self.switch is not None:
                try:
                    self.switch.park(self._member_urls(), max(0.0, deadline - time.monotonic()))
                except MemberSwitchError as exc:
                    self._register()
                    self._event(GroupState.READY, f"park failed, serving again: {exc}")
                    raise BackendError(f"group {self.spec.name}: park failed, still Ready: {exc}") from None
            self.standby = True
            took = time.monotonic() - t0
            self._event(GroupState.STANDBY, f"parked: loaded and warm, KV released ({took:.2f}s)")
            return took

    def _drain(self, deadline: float) -> None:
        """Weight 0, then wait until `deadline` for the router's in-flight requests to end. A group that fell
        meanwhile is out of routing already (the router refuses its weight): nothing is left to wait for."""
        try:
            self.router.set_weights({self.spec.name: 0.0})
        except TideflowError as exc:
            log.info("group %s: not routed any more, nothing to drain (%s)", self.spec.name, exc)
            return
        wait_drained(self.router, self.spec.name, deadline)

    def _match_members(self, handle: GroupHandle) -> str | None:
        """Members started silent (or serving) while `standby` was flipped since: switch them to match."""
        if self.switch is None or handle.standby == self.standby:
            return None
        try:
            if self.standby:
                self.switch.park(self._member_urls(), 0.0)
            else:
                self.switch.activate(self._member_urls())
        except MemberSwitchError as exc:
            return str(exc)
        return None

    def _member_urls(self) -> list[str]:
        return [m.endpoint for m in self.status.members if m.endpoint]

    def drain_and_stop(self, drain_s: float = 30.0) -> None:
        """Stop new traffic, wait for in-flight requests (bounded), then stop every member."""
        if self.router is not None and self.status.state == GroupState.READY:
            self._event(GroupState.DRAINING, "weight 0, waiting for in-flight requests")
            self._drain(time.monotonic() + drain_s)
        self._stop.set()
        self._thread.join(timeout=drain_s + 30)
        self._event(GroupState.STOPPED, "all members stopped")


def _describe(m: MemberStatus) -> str:
    return f"{m.role} instance {m.instance} rank {m.rank} {m.phase.value}: {m.message}".strip()


class GroupManager:
    """All groups of one group set, and the router they register with."""

    def __init__(self, backend: Backend, router: Routing | None, policy: SupervisionPolicy | None = None,
                 member_key: Key = None,
                 on_fall: Callable[[ManagedGroup, str], None] | None = None) -> None:
        self.backend, self.router, self.on_fall = backend, router, on_fall
        self.switch = MemberSwitch(member_key)  # the key members accept on their /admin routes
        self.policy = policy or SupervisionPolicy()
        self.groups: dict[str, ManagedGroup] = {}

    def up(self, spec: InferenceGroup, standby: bool = False, weight: float = 1.0,
           adopted: GroupHandle | None = None) -> ManagedGroup:
        """Supervise `spec`: start its members, or watch `adopted` ones already running."""
        if spec.name in self.groups and self.groups[spec.name].status.state not in (GroupState.STOPPED, GroupState.FAILED):
            raise BackendError(f"group {spec.name} is already managed ({self.groups[spec.name].status.state.value})")
        managed = ManagedGroup(spec, self.backend, self.router, self.policy, standby, weight,
                               self.switch, adopted)
        managed.on_fall = self.on_fall
        managed.start()
        self.groups[spec.name] = managed
        return managed

    def status(self) -> list[GroupStatus]:
        return [g.status for g in self.groups.values()]

    def shutdown(self, drain_s: float = 10.0) -> None:
        for g in list(self.groups.values()):
            if g.status.state not in (GroupState.STOPPED, GroupState.FAILED):
                g.drain_and_stop(drain_s)
        self.switch.close()

