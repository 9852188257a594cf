"""The controller: owns the router, the groups and the warm pools of a fleet, outlives every flow run.

Desired state (specs, weights, serving/standby, pools, autoscalers, the last canary) is durable in
the runtime's store (SQLite here, a ConfigMap on Kubernetes) and written only by user verbs; the
controller's own decisions (a warm replacement's swap) are kept beside it as GroupDecisions; observed
state is read from the members each time; a reconcile loop closes the gap every pass (existence,
weight and serving/standby) and records each group's conditions. The data path (client -> router -> members)
never passes through the controller: routers keep the last route set they watched, so killing the
controller stops no request, and a restarted one adopts what runs (engine/control/runtime.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

import httpx

from engine.control.conditions import ConditionBook, observe
from engine.control.expert_moves import MovesReporter, RunningGroup
from engine.control.metrics import CanaryGauge, ControllerMetrics, FleetSnapshot
from engine.control.models import (ApplyGroup, AutoscalerBody, AutoscalerView, CanaryRecord, FleetStatus, GroupView,
                                   DesiredView, Killed, KillMember, Lease, LeaseRequest, MemberView, ScalePool,
                                   WeightsSet)
from engine.control import discovery
from engine.control.audit import AUDIT_FILE, AuditLog
from engine.control.keys import KeyBook, Role, Rotated, RotationError
from engine.control.routes import RouteTable, replica_urls
from engine.control.targets import Job, TargetGroup, scrape_targets
from engine.control.local_runtime import LocalRuntime
from engine.control.runtime import ControllerConfig, Runtime
from engine.control.store import DesiredGroup, GroupDecision, effective
from engine.control.switch_claims import SwitchClaims
from engine.group.backend import BackendError
from engine.group.manager import GroupManager, GroupState, ManagedGroup
from engine.group.spec import InferenceGroup
from engine.runtime.http import bearer_client
from engine.router.admin import RouterAdminError, scrape_members
from engine.runtime.paths import home
from engine.scaling.autoscaler import Autoscaler, AutoscalerStopped
from engine.scaling.observe import SetObserver
from engine.scaling.policy import Bounds
from engine.scaling.pool import ScaleResult, WarmPool
from engine.api.auth import DIGEST_PREFIX, key_digest
from engine.transfer.shm import reap_orphan_segments

log = logging.getLogger(__name__)

_GONE = (GroupState.STOPPED, GroupState.FAILED)
_SETTLED = (GroupState.READY, GroupState.STANDBY)
CONVERGE_RETRY_MAX_S = 60.0  # a park or activation that failed is tried again after 1 s, doubling up to this
DEFAULT_SERVING_WEIGHT = 100.0  # per unit of capacity, the scale the release puts its groups on


class ControlError(Exception):
    """A request the controller cannot carry out; `status` is the HTTP status the API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Controller:
    """One per TIDEFLOW_HOME (or namespace). `start()` adopts or starts the router and every desired group."""

    def __init__(self, config: ControllerConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        self.runtime = runtime or make_runtime(config)
        self.store, self.backend = self.runtime.store, self.runtime.backend
        self.port, self.url = self.runtime.port, self.runtime.url  # where the API listens; routers watch url
        self.keys = KeyBook(self.store, home() / "keys")  # admin, client, routes, upstream (engine.control.keys)
        self.keys.publish()  # the routers' key files, before any router starts
        self._member_key = lambda: self.keys.current("upstream")  # controller -> members, read as each call goes
        self.routes = RouteTable()
        self.audit = AuditLog(home() / AUDIT_FILE)  # every control action and refused call (engine.control.audit)
        self._lock = threading.RLock()  # one mutation at a time: API calls and reconcile passes
        self._lease_lock = threading.Lock()  # the lease alone: a renewal never waits behind a long scale
        # desired state's read-modify-writes (a delete against a replacement's write-back on a supervisor thread,
        # which must not take the controller's lock: a stop joins that thread)
        self._desired_lock = threading.Lock()
        self._retries: dict[str, tuple[int, float]] = {}  # Failed but desired: (retries so far, next try at)
        self._stop = threading.Event()
        self._stoppers: dict[str, threading.Thread] = {}
        self.claims = SwitchClaims()  # who switches a group between serving and standby now
        self._converge_failed: dict[str, tuple[str, float, float]] = {}  # name: (error, retry at, pause)
        self.conditions = ConditionBook()
        self.pools: dict[str, WarmPool] = {}
        self.autoscalers: dict[str, tuple[Autoscaler, SetObserver]] = {}
        self.manager: GroupManager | None = None
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)
        self._adopted: list[str] = []  # groups taken over at start: routes are published once they settle
        self.metrics = ControllerMetrics(self._snapshot)
        self.expert_moves = MovesReporter(self._running_groups, self._member_key, self.store.event,
                                          config.expert_watch_s)

    @property
    def router_url(self) -> str:
        return self.runtime.router_url

    # -- start: adopt what runs, start what is missing ------------------------------------------
    def start(self) -> "Controller":
        self.routes.forget_replicas(self.runtime.ensure_router())
        self.manager = GroupManager(self.backend, self.routes, self.config.policy,
                                    member_key=self._member_key, on_fall=self._replace)
        self._adopted = self.runtime.adopt(self.manager)
        for name, body in self.store.autoscalers().items():
            self.start_autoscaler(AutoscalerBody.model_validate_json(body), record=False)
            self.store.event("autoscaler", f"resumed over pool {name}")
        self._thread.start()
        self.expert_moves.start()
        return self

    def _publish_when_settled(self, timeout_s: float) -> None:
        """Publish the route set once every adopted group has shown where it stands (Ready and registered,
        Standby, or fallen), so the first set the routers get holds every group that was serving; until
        then they keep theirs. Groups being rebuilt from scratch are not waited for."""
        deadline = time.monotonic() + timeout_s
        unsettled = (GroupState.PENDING, GroupState.STARTING)
        waiting = [n for n in self._adopted if n in self.manager.groups]
        while waiting and time.monotonic() < deadline and not self._stop.is_set():
            waiting = [n for n in waiting if self.manager.groups[n].status.state in unsettled]
            time.sleep(0.05)
        if waiting:
            self.store.event("adopt", f"not Ready {timeout_s:g}s after adoption, routed once they are: {', '.join(waiting)}")
        self.routes.publish()

    # -- the reconcile loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        self._publish_when_settled(self.config.adopt_wait_s)
        while not self._stop.wait(self.config.reconcile_s):
            try:
                self.reconcile()
            except Exception:  # one bad pass must not end supervision; the next pass tries again
                log.exception("reconcile pass failed")

    def reconcile(self) -> None:
        with self._lock:
            self.routes.forget_replicas(self.runtime.ensure_router())
            desired = self.store.groups()
            decisions = self.store.decisions()
            managed = self.manager.groups
            for name, spec_want in desired.items():
                want = effective(spec_want, decisions.get(name))
                g = managed.get(name)
                if name in self._stoppers:
                    continue
                if g is None or g.status.state == GroupState.STOPPED:
                    g = self.manager.up(want.spec, standby=want.standby, weight=want.weight)
                elif g.status.state == GroupState.FAILED:
                    self._retry_failed(g, want)
                elif g.status.state in _SETTLED:
                    self._retries.pop(name, None)
                    self._converge(g, want)
                self._observe(name, want)
            for name, g in list(managed.items()):
                if name in desired or name in self._stoppers:
                    continue
                if g.status.state in _GONE:
                    managed.pop(name, None)  # deleted and stopped: status no longer lists it
                    self.conditions.forget(name)
                    self._converge_failed.pop(name, None)
                else:
                    self._stop_in_background(g)
            self._stoppers = {n: t for n, t in self._stoppers.items() if t.is_alive()}
        reap_orphan_segments()  # KV segments of members that died mid-transfer
        self.runtime.renew_certificates()

    def _converge(self, g: ManagedGroup, want: DesiredGroup) -> None:
        """Bring a settled group's weight and serving/standby to what is wanted (caller holds the lock): a park
        or activation that failed (a member that would not drain) is tried again on later passes, after a pause
        that doubles up to CONVERGE_RETRY_MAX_S, and shows meanwhile as Converged=False with its error. A park
        runs on a thread of its own (it drains); a group someone else is switching is left alone."""
        name = g.spec.name
        if self.claims.busy(name):
            return
        if g.weight != want.weight or (g.status.state == GroupState.READY
                                       and self.routes.weight_of(name) not in (None, want.weight)):
            g.weight = want.weight
            if g.status.state == GroupState.READY:
                try:
                    self.routes.set_weights({name: want.weight})
                except RouterAdminError as exc:  # not registered yet: its registration carries g.weight
                    log.info("group %s: weight %g not routed yet (%s)", name, want.weight, exc)
        if want.standby == (g.status.state == GroupState.STANDBY):
            self._converge_failed.pop(name, None)
            return
        _, retry_at, pause = self._converge_failed.get(name, ("", 0.0, 0.0))
        if time.monotonic() < retry_at:
            return
        verb = "park" if want.standby else "activate"
        switch: Callable[[], float] = g.park if want.standby else g.activate

        def run() -> None:
            try:
                if not self._still_wanted(g, want.standby):  # a verb or a replacement switched it since the pass read
                    return
                took = switch()
            except BackendError as exc:
                wait = min(max(2 * pause, 1.0), CONVERGE_RETRY_MAX_S)
                if self.manager.groups.get(name) is g:  # not for a group deleted meanwhile
                    self._converge_failed[name] = (f"{verb} failed: {exc}", time.monotonic() + wait, wait)
                self.store.event("converge", f"group {name}: {verb} failed ({exc}); trying again in {wait:g}s")
                return
            finally:
                self.claims.release(name)
            self._converge_failed.pop(name, None)
            done = "parked" if want.standby else "activated"
            self.store.event("converge", f"group {name}: {done} to match desired state ({took:.2f}s)")

        self.claims.start(name, run)  # not when a verb claimed it since busy() looked: that verb does the switch

    def _still_wanted(self, g: ManagedGroup, standby: bool) -> bool:
        """Whether spec + decision, read now, still want `g` switched to `standby` (it is still desired as it runs)."""
        with self._desired_lock:
            desired = self.store.groups().get(g.spec.name)
            if desired is None or desired.spec != g.spec:
                return False
            return effective(desired, self.store.decisions().get(g.spec.name)).standby == standby

    def _observe(self, name: str, want: DesiredGroup) -> None:
        """Record the group's conditions for this pass (caller holds the lock)."""
        g = self.manager.groups.get(name)
        if g is None:
            return
        _, at = self._retries.get(name, (0, None))
        failed = self._converge_failed.get(name)
        self.conditions.record(name, observe(g.status, want, g.weight, self.routes.weight_of(name),
                                             g.status.state == GroupState.STANDBY,
                                             None if at is None else max(0.0, at - time.monotonic()),
                                             failed[0] if failed else None))

    def _retry_failed(self, g: ManagedGroup, want: DesiredGroup) -> None:
        """A group that gave up (Failed) but is still desired is built again, after the policy's backoff_max_s,
        doubling per try up to failed_retry_max_s (caller holds the lock): a substrate that refused for a while
        (no node, a registry outage) must not leave a desired group down until someone notices."""
        name, policy, now = g.spec.name, self.config.policy, time.monotonic()
        tries, at = self._retries.get(name, (0, None))
        if at is None:
            delay = min(policy.backoff_max_s * 2 ** tries, policy.failed_retry_max_s)
            self._retries[name] = (tries, now + delay)
            self.store.event("retry", f"group {name} failed ({g.status.events[-1].message if g.status.events else ''}); "
                                      f"building it again in {delay:.0f}s (retry {tries + 1})")
            return
        if now < at:
            return
        self._retries[name] = (tries + 1, None)
        self.manager.groups.pop(name, None)
        self.manager.up(want.spec, standby=want.standby, weight=want.weight)

    def _replace(self, fallen: ManagedGroup, why: str) -> None:
        """Warm replacement, on the fallen group's supervisor thread the moment it leaves the router: a standby
        group of the same version and shape takes its weight at once, and the fallen group is rebuilt into
        the warm pool. With no standby, the other serving groups take the traffic while it is rebuilt.
        (No controller lock: activation locks only the group it flips, and the store is thread-safe.)"""
        same = _shape(fallen.spec)
        for g in list(self.manager.groups.values()):
            if g is fallen or g.status.state != GroupState.STANDBY or _shape(g.spec) != same:
                continue
            with self.claims.holding(g.spec.name):
                g.weight = fallen.weight
                try:
                    took = g.activate()
                except BackendError:
                    continue  # taken by another replacement, or it fell too: try the next one
                fallen.standby = True  # rebuilt silent: it refills the pool
                self._decide(g, f"serves in place of {fallen.spec.name}, which fell ({why})")
                self._decide(fallen, f"fell ({why}); rebuilt into the warm pool, {g.spec.name} serves in its place")
            self.metrics.activation.labels("replacement").observe(took)
            self.store.event("replace", f"{fallen.spec.name} fell ({why}); standby {g.spec.name} serves "
                                        f"(activated in {took * 1000:.0f} ms); {fallen.spec.name} is rebuilt into the pool")
            return
        self.store.event("replace", f"{fallen.spec.name} fell ({why}); no standby of its version: the other "
                                    "serving groups take its traffic while it is rebuilt")

    def _stop_in_background(self, g: ManagedGroup, drain_s: float = 10.0) -> threading.Thread:
        """The one stop of `g` (caller holds the lock): reconcile skips a group while its stop runs."""
        t = threading.Thread(target=g.drain_and_stop, args=(drain_s,), name=f"stop-{g.spec.name}", daemon=True)
        self._stoppers[g.spec.name] = t
        t.start()
        return t

    # -- verbs (the API calls these) ----------------------------------------------------------------
    def apply(self, body: ApplyGroup) -> GroupView:
        name = body.spec.name
        with self._lock:
            g = self.manager.groups.get(name)
            stopping = self._stoppers.get(name)
            if stopping is not None and stopping.is_alive():
                raise ControlError(409, f"group {name} is stopping; apply it again once it is gone")
            if g is not None and g.status.state not in _GONE and g.spec != body.spec:
                raise ControlError(409, f"group {name} runs another spec ({g.spec.version}); delete it first "
                                        "or apply under a new name (a canary)")
            with self._desired_lock:
                self.store.put_group(DesiredGroup(spec=body.spec, weight=body.weight, standby=body.standby))
                self.store.put_decision(name, None)  # the user's whole word on the group: it supersedes any decision
            self._retries.pop(name, None)
            self.store.event("apply", f"group {name} {body.spec.version} weight {body.weight:g}"
                                      f"{' standby' if body.standby else ''}")
            if g is None or g.status.state in _GONE:
                self.manager.groups.pop(name, None)
                g = self.manager.up(body.spec, standby=body.standby, weight=body.weight)
            else:
                g.weight = body.weight
                if g.status.state == GroupState.READY:
                    self.routes.set_weights({name: body.weight})
            # switched here, claimed before the lock is let go (else a reconcile pass would start the same switch);
            # when a converge thread already switches it, that thread does this apply's work
            switch = body.standby == (g.status.state == GroupState.READY) and g.status.state in _SETTLED
            switch = switch and self.claims.claim(name)
        if switch:
            try:
                self._switch(g, body.standby)
            finally:
                self.claims.release(name)
        return self.view(name)

    def delete(self, name: str, drain_s: float = 10.0) -> None:
        """Forget the group's desired state, then stop it once: the stop is registered where reconcile looks,
        so a pass meanwhile neither stops it again nor starts it. Waits for the stop outside the lock."""
        with self._lock:
            with self._desired_lock:
                known = self.store.delete_group(name)
            g = self.manager.groups.get(name)
            if not known and g is None:
                raise ControlError(404, f"no group named {name!r}")
            self._retries.pop(name, None)
            self.store.event("delete", f"group {name}")
            stopper = self._stoppers.get(name)
            if stopper is None and g is not None and g.status.state not in _GONE:
                stopper = self._stop_in_background(g, drain_s)
        if stopper is not None:
            stopper.join(timeout=drain_s + 60)
        with self._lock:
            if stopper is not None and not stopper.is_alive() and self._stoppers.get(name) is stopper:
                del self._stoppers[name]  # stopped: an apply of the name right after is a new group, not a 409
            if self.manager.groups.get(name) is g and name not in self.store.groups():
                self.manager.groups.pop(name, None)

    def set_weights(self, weights: dict[str, float]) -> WeightsSet:
        """All or nothing: the route set takes every weight, and only then are they stored as desired state. A
        weight the routers refused is never kept, so a restarted controller serves what the routers served."""
        with self._lock:
            desired = self.store.groups()
            unknown = sorted(set(weights) - set(desired))
            if unknown:
                raise ControlError(404, f"unknown groups: {', '.join(unknown)}")
            try:
                applied = self.routes.set_weights(weights)  # checks every name before it changes any
            except RouterAdminError as exc:
                raise ControlError(409, f"no weight changed: {exc}") from None
            for name, w in weights.items():
                with self._desired_lock:  # read again under the lock: a replacement may have decided since
                    current = self.store.groups().get(name)
                    if current is not None:
                        self.store.put_group(current.model_copy(update={"weight": w}))
                    decision = self.store.decisions().get(name)
                    if decision is not None:  # the user's weight holds whoever decided serving or standby
                        self.store.put_decision(name, decision.model_copy(update={"weight": w}))
                if name in self.manager.groups:
                    self.manager.groups[name].weight = w
            self.store.event("weights", ", ".join(f"{n} {w:g}" for n, w in sorted(weights.items())))
            return WeightsSet(weights=applied, revision=self.routes.revision)

    def activate(self, name: str) -> float:
        g = self._group(name)
        with self.claims.holding(name):
            return self._switch(g, standby=False)

    def park(self, name: str, drain_s: float = 30.0) -> float:
        g = self._group(name)
        with self.claims.holding(name):
            return self._switch(g, standby=True, drain_s=drain_s)

    def _switch(self, g: ManagedGroup, standby: bool, drain_s: float = 30.0) -> float:
        """A user's park or activation (the caller has claimed the group), written as the spec once done."""
        try:
            took = g.park(drain_s) if standby else g.activate()
        except BackendError as exc:
            raise ControlError(409, str(exc)) from None
        if not standby:
            self.metrics.activation.labels("api").observe(took)
        self._user_switched(g)
        return took

    def kill_member(self, name: str, body: KillMember) -> Killed:
        """Kill one member through the backend (what fault drills do; no caller needs a pid of its own)."""
        g = self._group(name)
        handle = g.status.handle
        if handle is None or g.status.state != GroupState.READY:
            raise ControlError(409, f"group {name} is {g.status.state.value}, not Ready")
        members = self.backend.identities(handle)
        if body.target == "expert":
            candidates = [m for m in members if m.rank > 0]
        else:
            candidates = [m for m in members if m.role == body.target]
        if not candidates:
            raise ControlError(404, f"group {name} has no {body.target} member to kill")
        member = candidates[0]
        g.expect_drill_kill(member.role, member.instance, member.rank)  # its rebuild spends no crash budget
        try:
            landed = self.backend.kill(handle, member)
        except BackendError as exc:
            g.forget_drill_kill(member.role, member.instance, member.rank)
            raise ControlError(409, str(exc)) from None
        if not landed:  # still running: a later fall of it would be a crash, not this drill
            g.forget_drill_kill(member.role, member.instance, member.rank)
        where = f"{member.role}/{member.instance}/{member.rank}"
        self.store.event("kill", f"group {name}: killed {where} ({member.id}){'' if landed else ' (still running!)'}")
        return Killed(member=where, id=member.id, handle=handle.id, before=[m.id for m in members], landed=landed)

    def kill_router(self) -> Killed:
        """Kill one router replica (a fault drill); the next reconcile pass starts it again on the same port."""
        with self._lock:  # not while a reconcile pass checks or restarts it
            try:
                what, landed = self.runtime.kill_router()
            except BackendError as exc:
                raise ControlError(409, str(exc)) from None
        self.store.event("kill", f"router: killed ({what}){'' if landed else ' (still running!)'}")
        return Killed(member="router", id=what, handle="router", before=[what], landed=landed)

    def scale_pool(self, body: ScalePool) -> ScaleResult:
        with self._lock:
            pool = self._pool(body.template, body.bounds, body.warm_pool)
            return self._scale(pool, body.target, body.floor)

    def _pool(self, template: InferenceGroup, bounds: Bounds, warm_pool: int) -> WarmPool:
        """The warm pool of `template` (its groups are <name>-<i>: a restarted controller finds them again)."""
        pool = self.pools.get(template.name)
        if pool is None or pool.template != template or pool.bounds != bounds:
            pool = self.pools[template.name] = WarmPool(self.manager, template, bounds, warm_pool,
                                                        weight_of=self._capacity_weight)
        pool.warm_pool = warm_pool
        return pool

    def _capacity_weight(self, spec: InferenceGroup) -> float:
        """The weight that gives a group joining the serving set traffic in proportion to its capacity: the serving
        groups' weight per unit of capacity, times its own (a tidal copy beside a release group at 100 takes its
        share, not 1 %). DEFAULT_SERVING_WEIGHT when nothing serves."""
        serving = [g for g in list(self.manager.groups.values())
                   if g.status.state == GroupState.READY and g.weight > 0 and g.spec.serving_capacity > 0]
        if not serving:
            return DEFAULT_SERVING_WEIGHT * spec.serving_capacity
        per_unit = sum(g.weight for g in serving) / sum(g.spec.serving_capacity for g in serving)
        return per_unit * spec.serving_capacity

    def _scale(self, pool: WarmPool, target: int, floor: int | None) -> ScaleResult:
        """scale_to, then the pool's groups written back as desired state (caller holds the lock)."""
        result = pool.scale_to(target, floor)
        name = pool.template.name
        self.metrics.observe_scale(name, len(result.activated), len(result.parked), len(result.cold_started),
                                   len(result.refilled), len(result.stopped))
        for took in result.activation_s:
            self.metrics.activation.labels("pool").observe(took)
        for g in pool.groups():
            with self._desired_lock:  # the pool's copies are desired as the pool made them
                if g.spec.name in result.stopped or g.status.state in _GONE:
                    self.store.delete_group(g.spec.name)
                else:
                    self.store.put_group(DesiredGroup(spec=g.spec, weight=g.weight, standby=g.standby))
                    self.store.put_decision(g.spec.name, None)
        if result.changed:
            self.store.event("scale", f"pool {pool.template.name} -> {result.target}: serving {result.serving}, "
                                      f"standby {result.standby}, activated {result.activated}, parked {result.parked}, "
                                      f"cold-started {result.cold_started}, stopped {result.stopped}")
        return result

    # -- the autoscaler policy, kept running by the controller ------------------------------------------
    def start_autoscaler(self, body: AutoscalerBody, record: bool = True) -> AutoscalerView:
        """Run `body`'s policy over its pool, in place of the autoscaler that ran there. The old one is told to
        stop under the lock (a tick of it waiting for the lock then scales nothing) and joined after it."""
        name = body.template.name
        with self._lock:
            old = self._detach_autoscaler(name)
            pool = self._pool(body.template, body.policy.bounds, body.policy.warm_pool)
            observer = SetObserver(lambda: replica_urls(self.routes.replicas(), self.router_url),
                                   lambda: self.client_key, self._member_key,
                                   lambda: [m.endpoint for g in pool.serving() for m in g.status.members if m.endpoint])
            locked = _LockedPool(self, pool)
            scaler = locked.scaler = Autoscaler(locked, body.policy, observe=observer if body.policy.metrics else None)
            scaler.start()
            self.autoscalers[name] = (scaler, observer)
            if record:
                self.store.put_autoscaler(name, body.model_dump_json())
                self.store.event("autoscaler", f"started over pool {name} (tick {body.policy.tick_s:g}s)")
            view = self.autoscaler_view(name)
        _finish(old)
        return view

    def stop_autoscaler(self, name: str, forget: bool = True) -> bool:
        with self._lock:
            running = self._detach_autoscaler(name)
            known = self.store.delete_autoscaler(name) if forget else False
            if forget and (running or known):
                self.store.event("autoscaler", f"stopped over pool {name}")
        _finish(running)
        return running is not None or known

    def _detach_autoscaler(self, name: str) -> tuple[Autoscaler, SetObserver] | None:
        """Take the pool's autoscaler out and tell it to stop (caller holds the lock; _finish joins it after)."""
        running = self.autoscalers.pop(name, None)
        if running is not None:
            running[0].stop(wait=False)
        return running

    def autoscaler_view(self, name: str) -> AutoscalerView:
        if name not in self.autoscalers:
            raise ControlError(404, f"no autoscaler over pool {name!r}")
        scaler = self.autoscalers[name][0]
        events = list(scaler.events)
        return AutoscalerView(name=name, policy=scaler.policy, decisions=sum(1 for e in events if e.result is not None),
                              last=[e.model_dump(mode="json") for e in events[-20:]])

    def _decide(self, g: ManagedGroup, reason: str) -> None:
        """Keep the controller's own decision on `g` (as it now runs) beside its spec, if it is still desired: a
        group deleted meanwhile (a replacement ran on its supervisor thread while it was being deleted) stays
        deleted, and the spec stays what the user wrote."""
        with self._desired_lock:
            desired = self.store.groups().get(g.spec.name)
            if desired is not None and desired.spec == g.spec:
                self.store.put_decision(g.spec.name, GroupDecision(standby=g.standby, weight=g.weight, reason=reason,
                                                                   at=time.time()))

    def _user_switched(self, g: ManagedGroup) -> None:
        """A user's activate or park: the spec now says the group runs as it does, and any decision of the
        controller's over it is superseded."""
        with self._desired_lock:
            desired = self.store.groups().get(g.spec.name)
            if desired is not None and desired.spec == g.spec:
                self.store.put_group(desired.model_copy(update={"weight": g.weight, "standby": g.standby}))
                self.store.put_decision(g.spec.name, None)

    def _group(self, name: str) -> ManagedGroup:
        g = self.manager.groups.get(name)
        if g is None:
            raise ControlError(404, f"no group named {name!r}")
        return g

    # -- observation -------------------------------------------------------------------------------
    def view(self, name: str) -> GroupView:
        g = self._group(name)
        s = g.status
        ids = []
        if s.handle is not None:
            try:
                ids = self.backend.identities(s.handle)
            except BackendError:
                ids = []  # the build just ended: no member to name
        by_place = {(i.role, i.instance, i.rank): i for i in ids}
        members = []
        for m in s.members:
            ident = by_place.get((m.role, m.instance, m.rank))
            members.append(MemberView(role=m.role, instance=m.instance, rank=m.rank, endpoint=m.endpoint,
                                      phase=m.phase.value, pid=ident.pid if ident else None,
                                      id=ident.id if ident else None))
        want = self.store.groups().get(name)
        return GroupView(name=s.name, version=s.version, state=s.state, weight=g.weight, standby=g.standby,
                         restarts=s.restarts, drill_rebuilds=s.drill_rebuilds, handle=s.handle.id if s.handle else None,
                         message=s.events[-1].message if s.events else "", last_activation_s=s.last_activation_s,
                         members=members, spec=g.spec,
                         desired=DesiredView(weight=want.weight, standby=want.standby) if want is not None else None,
                         decision=self.store.decisions().get(name) if want is not None else None,
                         conditions=self.conditions.of(name), expert_moves=self.expert_moves.watch.totals.get(name))

    def status(self) -> FleetStatus:
        with self._lock:
            names = sorted(self.manager.groups)
        canary = self.store.canary()
        return FleetStatus(router_url=self.router_url, router_pids=self.runtime.router_pids(), backend=self.config.backend,
                           router_replicas=self.routes.replicas(), controller_pid=os.getpid(), groups=[self.view(n) for n in names],
                           canary=CanaryRecord.model_validate_json(canary) if canary else None, lease=self.lease())

    def record_canary(self, record: CanaryRecord) -> CanaryRecord:
        record = record.model_copy(update={"at": time.time()})
        self.store.put_canary(record.model_dump_json())
        if record.decision is not None:
            self.metrics.canary_decisions.labels(record.decision).inc()
        what = record.decision or f"step {record.step} at {record.percent:g} %"
        self.store.event("canary", f"{record.canary} over {record.stable}: {what} {record.reason}".strip())
        return record

    # -- the fleet lease: one changing flow run at a time ------------------------------------------------
    def lease(self) -> Lease | None:
        """The live lease (a lapsed one counts as none)."""
        body = self.store.lease()
        lease = Lease.model_validate_json(body) if body else None
        return lease if lease is not None and lease.expires_at > time.time() else None

    def acquire_lease(self, body: LeaseRequest) -> Lease:
        """Granted when nobody holds the fleet, or renewed for its holder; 409 naming the holder otherwise.
        Durable in the store: a restarted controller still refuses a second canary while the first runs."""
        with self._lease_lock:
            now, held = time.time(), self.lease()
            if held is not None and held.holder != body.holder:
                raise ControlError(409, f"the fleet is being changed by {held.purpose} (run {held.holder}, for "
                                        f"{now - held.acquired_at:.0f}s; the lease lapses in {held.expires_at - now:.0f}s "
                                        "unless renewed): start this run again once that one has ended")
            lease = Lease(holder=body.holder, purpose=body.purpose, acquired_at=held.acquired_at if held else now,
                          expires_at=now + body.ttl_s)
            self.store.put_lease(lease.model_dump_json())
            if held is None:
                self.store.event("lease", f"{body.purpose} ({body.holder}) holds the fleet")
            return lease

    def release_lease(self, holder: str) -> bool:
        """Let go; False when `holder` did not hold it (it lapsed, or another run holds it now)."""
        with self._lease_lock:
            held = self.lease()
            if held is None or held.holder != holder:
                return False
            self.store.put_lease(None)
            self.store.event("lease", f"{held.purpose} ({holder}) let the fleet go")
            return True

    def _snapshot(self) -> FleetSnapshot:
        """What Prometheus reads of the fleet now (engine.control.metrics)."""
        groups = list(self.manager.groups.values()) if self.manager is not None else []
        record = self.store.canary()
        canary = CanaryRecord.model_validate_json(record) if record else None
        return FleetSnapshot(
            groups=[(g.status.model_copy(deep=True), g.weight, g.standby) for g in groups],
            canary=None if canary is None or canary.decision is not None else
            CanaryGauge(stable=canary.stable, canary=canary.canary, step=canary.step, percent=canary.percent))

    def _running_groups(self) -> list[RunningGroup]:
        """Each group serving or warm now: what the expert move reports read."""
        groups = list(self.manager.groups.values()) if self.manager is not None else []
        # only a Ready or Standby group: its members were observed under its current build (a rebuild turns it
        # Starting before it takes a new handle, and its members are observed anew before it is Ready again)
        return [(g.spec, g.status.handle.id, list(g.status.members)) for g in groups
                if g.status.state in (GroupState.READY, GroupState.STANDBY) and g.status.handle is not None]

    @property
    def admin_key(self) -> str:
        """The control API's key (`tideflow keys rotate admin` replaces it)."""
        return self.keys.current("admin")

    @property
    def client_key(self) -> str:
        """The router's clients' key ($TIDEFLOW_HOME/router.key)."""
        return self.keys.current("client")

    @property
    def routes_key(self) -> str:
        """What router replicas send to watch the route set, and nothing else."""
        return self.keys.current("routes")

    def key_roles(self) -> dict[str, str]:
        """Each accepted key's digest -> the role the audit log names it by (the keys themselves never leave
        here; an old key in its grace is held only as its SHA-256, whose head is the same digest)."""
        roles = {}
        for role in ("admin", "client", "routes"):
            for k in self.keys.accepted(role):
                roles[k.key[len(DIGEST_PREFIX):][:16] if k.key.startswith(DIGEST_PREFIX) else key_digest(k.key)] = role
        return roles

    def rotate_key(self, role: Role, grace_s: float, wait_s: float = 15.0) -> Rotated:
        """A new key for `role`, working at once; the old one works for `grace_s` more, then is refused
        everywhere. The client and routes keys reach every router replica (their key files, read again when
        they change) before the client key file is replaced, so no client holds a key a router does not take; the
        upstream key reaches every member before anyone sends it (_announce_member_key)."""
        try:
            self.keys.check_rotatable()
            coming = self._announce_member_key(wait_s) if role == "upstream" else None
            new, until = self.keys.rotate(role, grace_s, coming)
        except RotationError as exc:
            raise ControlError(409, str(exc)) from None
        self.keys.publish()
        routers = 0
        if role in ("client", "routes", "upstream"):
            deadline, want = time.monotonic() + wait_s, self.keys.router_state()
            while True:
                live = self.routes.replicas()
                behind = [r["replica"] for r in live if r.get("key_state") != want]
                if live and not behind:
                    routers = len(live)
                    break
                if time.monotonic() > deadline:
                    raise ControlError(504, f"the new {role} key works here, but router replicas {behind or '(none)'} "
                                            f"did not take it within {wait_s:g}s; the old one works until its grace "
                                            "ends: see their logs")
                time.sleep(0.1)
        if role == "client":
            discovery.set_router_key(new)
        elif role == "admin":
            discovery.rekey(os.getpid(), new)
        self.store.event("keys", f"{role} key rotated; the old one works until {time.strftime('%H:%M:%S', time.localtime(until))}")
        return Rotated(role=role, grace_s=grace_s, old_until=until, routers=routers)

    def _announce_member_key(self, wait_s: float) -> str:
        """A new upstream key that every running member accepts (beside the old one) before anyone sends it: their
        key file lists it, and each member answers it. Members started meanwhile read the same file."""
        coming = secrets.token_urlsafe(24)
        self.keys.publish_members(coming)
        deadline = time.monotonic() + wait_s
        with bearer_client(coming, timeout_s=2.0) as client:
            while True:
                behind = []
                for _, _, members in self._running_groups():
                    for m in members:
                        try:
                            ok = m.endpoint is None or client.get(m.endpoint + "/internal/stats").status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        if not ok:
                            behind.append(m.endpoint)
                if not behind:
                    return coming
                if time.monotonic() > deadline:
                    self.keys.publish_members()  # withdrawn: nothing changed
                    raise ControlError(504, f"members {behind} did not accept the new upstream key within {wait_s:g}s "
                                            "(members started by an older tideflow verify the key they started with: "
                                            "rebuild their groups); nothing was rotated")
                time.sleep(0.1)

    def scrape_targets(self, job: Job) -> list[TargetGroup]:
        """What Prometheus should scrape for `job` now (engine.control.targets)."""
        members = [m.endpoint for _, _, ms in self._running_groups() for m in ms if m.endpoint]
        return scrape_targets(job, replica_urls(self.routes.replicas(), self.router_url), members)

    def member_metrics(self) -> list[str]:
        """Prometheus expositions of every routed member (the canary's direct source reads them)."""
        with bearer_client(self._member_key) as c:
            return scrape_members(c, self.routes.groups())

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self, stop_fleet: bool, drain_s: float = 5.0) -> None:
        """Stop reconciling. `stop_fleet`: also stop every group and the router and forget desired state
        (`tideflow down`); otherwise they keep serving for the next controller to adopt."""
        self._stop.set()
        self.expert_moves.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.claims.join(timeout_s=60)  # no switch may still run while the groups stop (or are left for the next one)
        for name in list(self.autoscalers):
            self.stop_autoscaler(name, forget=stop_fleet)
        if stop_fleet:
            with self._lock:
                with self._desired_lock:
                    for name in self.store.groups():
                        self.store.delete_group(name)
                if self.manager is not None:
                    self.manager.shutdown(drain_s)
                for t in self._stoppers.values():
                    t.join(timeout=drain_s + 30)
                # The routers' watches end only now: while the groups drained, the routers took their weight 0
                # and reported what was still in flight (with the watches ended first, each drain waited out
                # its whole `drain_s`, as no router could report the revision that set it)
                self.routes.close()
                self.runtime.stop_leftovers()
                reap_orphan_segments()
                self.store.event("down", "every group and the router stopped")
        else:
            self.routes.close()


def make_runtime(config: ControllerConfig) -> Runtime:
    if config.backend == "kubernetes":
        from engine.control.k8s_runtime import KubernetesRuntime  # the kubernetes client only where it is used

        return KubernetesRuntime(config)
    return LocalRuntime(config)


def _finish(running: tuple[Autoscaler, SetObserver] | None) -> None:
    """Wait for a detached autoscaler's loop to end and close its observer (no lock held)."""
    if running is not None:
        running[0].stop()
        running[1].close()


class _LockedPool:
    """What the autoscaler scales: the controller's pool, each step under the controller's lock and
    written back as desired state, exactly as an API call would do it. A step of an autoscaler stopped while
    it waited for the lock scales nothing: the pool has another policy now, or none."""

    def __init__(self, controller: Controller, pool: WarmPool) -> None:
        self.controller, self.pool = controller, pool
        self.scaler: Autoscaler | None = None  # the autoscaler this pool serves (set once it is built)

    def capacity(self) -> int:
        return self.pool.capacity()

    def scale_to(self, n: int, floor: int | None = None) -> ScaleResult:
        with self.controller._lock:
            if self.scaler is not None and self.scaler.stopping:
                raise AutoscalerStopped(self.pool.template.name)
            return self.controller._scale(self.pool, n, floor)


def _shape(spec: InferenceGroup) -> str:
    """What makes two groups interchangeable: everything but the name (pool copies differ only by it)."""
    return spec.model_copy(update={"name": "_", "warm_pool": 0}).model_dump_json()
