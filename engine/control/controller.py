"""The controller: owns the router, the groups and the warm pools of this machine, outlives every flow run.

Desired state (specs, weights, serving/standby) is in SQLite (`Store`); observed state is read from
the processes; a reconcile loop closes the gap. The data path (client -> router -> members) never
passes through the controller: its processes run in sessions of their own, so killing the
controller stops no request, and a restarted controller re-adopts them by pid + start time + port
+ `/ready` instead of starting duplicates. What it cannot adopt it stops and rebuilds whole.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel, Field

from engine.control.models import (ApplyGroup, AutoscalerBody, AutoscalerView, CanaryRecord, FleetStatus, GroupView,
                                   Killed, KillMember, MemberView, ScalePool)
from engine.control.store import DesiredGroup, RouterRecord, Store
from engine.group.backend import BackendError
from engine.group.local import LocalProcessBackend, MemberRecord
from engine.group.manager import GroupManager, GroupState, ManagedGroup, SupervisionPolicy
from engine.group.spec import InferenceGroup, Member
from engine.http import bearer_client
from engine.paths import home
from engine.process import (Adopted, Child, adopt, free_port, loopback_members, port_free, start_service, tideflow_argv,
                            wait_http_ok)
from engine.control.routes import RouteTable
from engine.router.admin import RouterAdminError, scrape_members
from engine.router.app import ADMIN_KEYS_ENV, UPSTREAM_KEY_ENV
from engine.router.sync import ROUTES_KEY_ENV
from engine.scaling.autoscaler import Autoscaler
from engine.scaling.observe import SetObserver
from engine.scaling.policy import Bounds
from engine.scaling.pool import ScaleResult, WarmPool

log = logging.getLogger(__name__)

_GONE = (GroupState.STOPPED, GroupState.FAILED)


class ControlError(Exception):
    """A request the controller cannot carry out; `status` is the HTTP status the API answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ControllerConfig(BaseModel):
    model_dir: Path = Field(description="checkpoint of the router's tokenizer and of groups whose spec names none")
    model_name: str = Field("default", description="model id clients ask the router for")
    host: str = Field("127.0.0.1", description="bind address of the controller API, the router and the members")
    port: int = Field(0, ge=0, le=65535, description="controller API port (0 = the one it had, else any free port)")
    router_port: int = Field(0, ge=0, le=65535, description="router port (0 = the one it had, else any free port)")
    router_args: list[str] = Field(default_factory=list, description="extra `tideflow router` flags")
    reconcile_s: float = Field(0.5, gt=0, description="seconds between two reconcile passes")
    policy: SupervisionPolicy = Field(default_factory=SupervisionPolicy, description="how groups are supervised and rebuilt")


class Controller:
    """One per TIDEFLOW_HOME. `start()` adopts or starts the router and every desired group."""

    def __init__(self, config: ControllerConfig, store: Store | None = None) -> None:
        self.config = config
        self.store = store or Store(home() / "controller.db")
        self.admin_key = self.store.secret("controller_admin")  # the control API
        self.client_key = self.store.secret("router_client")  # clients of the router ($TIDEFLOW_HOME/router.key)
        self.routes_key = self.store.secret("routes")  # router replicas -> the route set, nothing else
        self._member_key = self.store.secret("member")  # router and controller -> members only
        self.port = _keep_port(self.store, config.host, config.port)  # the URL an adopted router watches
        self.url = f"http://{config.host}:{self.port}"
        self.store.set_setting("model_dir", str(config.model_dir))  # what `tideflow router-replica` serves with
        self.store.set_setting("model_name", config.model_name)
        self.routes = RouteTable()
        self._lock = threading.RLock()  # one mutation at a time: API calls and reconcile passes
        self._stop = threading.Event()
        self._stoppers: dict[str, threading.Thread] = {}
        self.pools: dict[str, WarmPool] = {}
        self.autoscalers: dict[str, tuple[Autoscaler, SetObserver]] = {}
        self.router: Child | Adopted | None = None
        self.router_url = ""
        self.backend = LocalProcessBackend(config.model_dir, self._member_key, config.model_name, home() / "logs",
                                           config.host, ledger=self.store)
        self.manager: GroupManager | None = None
        self._thread = threading.Thread(target=self._loop, name="reconcile", daemon=True)

    # -- start: adopt what runs, start what is missing ------------------------------------------
    def start(self) -> "Controller":
        self._ensure_router()
        self.manager = GroupManager(self.backend, self.routes, self.config.policy, home() / "groups",
                                    member_key=self._member_key, on_fall=self._replace)
        self._adopt_groups()
        for name, body in self.store.autoscalers().items():
            self.start_autoscaler(AutoscalerBody.model_validate_json(body), record=False)
            self.store.event("autoscaler", f"resumed over pool {name}")
        self._thread.start()
        return self

    def _ensure_router(self) -> None:
        """Adopt the recorded router when it is the same live process, watches this controller and answers;
        else start one. Either way it serves the route set it gets from this controller."""
        rec = self.store.router()
        if rec is not None:
            proc = adopt("router", rec.pid, rec.ticks, Path(rec.log_path))
            url = f"http://{self.config.host}:{rec.port}"
            if proc is not None and rec.controller_url == self.url and wait_http_ok(url + "/health", timeout_s=5):
                self.router, self.router_url = proc, url
                self.store.event("router", f"adopted router pid {rec.pid} on {url}")
                return
            if proc is not None:
                proc.stop()
        port = self.config.router_port or (rec.port if rec is not None else 0) or free_port(self.config.host)
        url = f"http://{self.config.host}:{port}"
        argv = tideflow_argv("router", "--host", self.config.host, "--port", str(port), "--model-name",
                             self.config.model_name, "--model-dir", str(self.config.model_dir),
                             "--controller-url", self.url, *loopback_members(self.config.host), *self.config.router_args)
        child = start_service(f"router-{port}", argv, home() / "logs" / f"router-{port}.log", url + "/health", 60,
                              router_env(self.store))
        self.store.set_router(RouterRecord(pid=child.pid, ticks=child.start_ticks, port=port, log_path=str(child.log_path),
                                           controller_url=self.url))
        self.router, self.router_url = child, url
        self.store.event("router", f"started router pid {child.pid} on {url}")


    def _adopt_groups(self) -> None:
        desired = self.store.groups()
        by_group: dict[str, list[list[MemberRecord]]] = defaultdict(list)
        for recs in _by_handle(self.store.members()).values():
            by_group[recs[0].group].append(recs)
        for name, builds in by_group.items():
            want = desired.get(name)
            keep = builds[-1] if want is not None and len(builds) == 1 else None
            for recs in builds:
                if recs is not keep:  # not wanted any more, or two builds of one group: none may stay twice
                    self._reap(recs)
            if keep is None:
                continue
            try:
                handle = self.backend.adopt(want.spec, keep, standby=want.standby)
            except BackendError as exc:
                self.store.event("adopt", f"group {name}: {exc}; rebuilding it whole")
                continue
            self.manager.up(want.spec, standby=want.standby, weight=want.weight, adopted=handle)
            self.store.event("adopt", f"group {name}: adopted {len(keep)} running members")

    def _reap(self, recs: list[MemberRecord]) -> None:
        _reap(self.store, recs)

    # -- the reconcile loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.config.reconcile_s):
            try:
                self.reconcile()
            except Exception:  # one bad pass must not end supervision; the next pass tries again
                log.exception("reconcile pass failed")

    def reconcile(self) -> None:
        with self._lock:
            if self.router is None or not self.router.alive():
                self.store.event("router", "router process gone; starting a new one")
                if self.router is not None:
                    self.router.stop()  # reap it
                self._ensure_router()
            desired = self.store.groups()
            managed = self.manager.groups
            for name, want in desired.items():
                g = managed.get(name)
                if (g is None or g.status.state == GroupState.STOPPED) and name not in self._stoppers:
                    self.manager.up(want.spec, standby=want.standby, weight=want.weight)
            for name, g in list(managed.items()):
                if name not in desired and g.status.state not in _GONE and name not in self._stoppers:
                    self._stop_in_background(g)
            self._stoppers = {n: t for n, t in self._stoppers.items() if t.is_alive()}

    def _replace(self, fallen: ManagedGroup, why: str) -> None:
        """Warm replacement, on the fallen group's supervisor thread the moment it leaves the router: a standby
        group of the same version and shape takes its weight at once, and the fallen group is rebuilt into
        the warm pool. With no standby, the other serving groups take the traffic while it is rebuilt.
        (No controller lock: activation locks only the group it flips, and the store is thread-safe.)"""
        same = _shape(fallen.spec)
        for g in list(self.manager.groups.values()):
            if g is fallen or g.status.state != GroupState.STANDBY or _shape(g.spec) != same:
                continue
            g.weight = fallen.weight
            try:
                took = g.activate()
            except BackendError:
                continue  # taken by another replacement, or it fell too: try the next one
            fallen.standby = True  # rebuilt silent: it refills the pool
            self._sync_desired(g)
            self._sync_desired(fallen)
            self.store.event("replace", f"{fallen.spec.name} fell ({why}); standby {g.spec.name} serves "
                                        f"(activated in {took * 1000:.0f} ms); {fallen.spec.name} is rebuilt into the pool")
            return
        self.store.event("replace", f"{fallen.spec.name} fell ({why}); no standby of its version: the other "
                                    "serving groups take its traffic while it is rebuilt")

    def _stop_in_background(self, g: ManagedGroup, drain_s: float = 10.0) -> None:
        t = threading.Thread(target=g.drain_and_stop, args=(drain_s,), name=f"stop-{g.spec.name}", daemon=True)
        self._stoppers[g.spec.name] = t
        t.start()

    # -- verbs (the API calls these) ----------------------------------------------------------------
    def apply(self, body: ApplyGroup) -> GroupView:
        name = body.spec.name
        with self._lock:
            g = self.manager.groups.get(name)
            if name in self._stoppers:
                raise ControlError(409, f"group {name} is stopping; apply it again once it is gone")
            if g is not None and g.status.state not in _GONE and g.spec != body.spec:
                raise ControlError(409, f"group {name} runs another spec ({g.spec.version}); delete it first "
                                        "or apply under a new name (a canary)")
            self.store.put_group(DesiredGroup(spec=body.spec, weight=body.weight, standby=body.standby))
            self.store.event("apply", f"group {name} {body.spec.version} weight {body.weight:g}"
                                      f"{' standby' if body.standby else ''}")
            if g is None or g.status.state in _GONE:
                self.manager.groups.pop(name, None)
                g = self.manager.up(body.spec, standby=body.standby, weight=body.weight)
            else:
                g.weight = body.weight
                if g.status.state == GroupState.READY:
                    self.routes.set_weights({name: body.weight})
        if body.standby and g.status.state == GroupState.READY:
            self.park(name)
        elif not body.standby and g.status.state == GroupState.STANDBY:
            self.activate(name)
        return self.view(name)

    def delete(self, name: str, drain_s: float = 10.0) -> None:
        with self._lock:
            known = self.store.delete_group(name)
            g = self.manager.groups.get(name)
            if not known and g is None:
                raise ControlError(404, f"no group named {name!r}")
            self.store.event("delete", f"group {name}")
        if g is not None and g.status.state not in _GONE:
            g.drain_and_stop(drain_s)

    def set_weights(self, weights: dict[str, float]) -> dict[str, float]:
        with self._lock:
            desired = self.store.groups()
            unknown = sorted(set(weights) - set(desired))
            if unknown:
                raise ControlError(404, f"unknown groups: {', '.join(unknown)}")
            for name, w in weights.items():
                self.store.put_group(desired[name].model_copy(update={"weight": w}))
                if name in self.manager.groups:
                    self.manager.groups[name].weight = w
            self.store.event("weights", ", ".join(f"{n} {w:g}" for n, w in sorted(weights.items())))
            try:
                return self.routes.set_weights(weights)
            except RouterAdminError as exc:
                raise ControlError(409, f"weights stored; they apply once the groups are Ready: {exc}") from None

    def activate(self, name: str) -> float:
        g = self._group(name)
        try:
            took = g.activate()
        except BackendError as exc:
            raise ControlError(409, str(exc)) from None
        with self._lock:
            self._sync_desired(g)
        return took

    def park(self, name: str, drain_s: float = 30.0) -> float:
        g = self._group(name)
        try:
            took = g.park(drain_s)
        except BackendError as exc:
            raise ControlError(409, str(exc)) from None
        with self._lock:
            self._sync_desired(g)
        return took

    def kill_member(self, name: str, body: KillMember) -> Killed:
        """SIGKILL one member through the backend (what fault drills do; no caller needs a pid of its own)."""
        g = self._group(name)
        handle = g.status.handle
        if handle is None or g.status.state != GroupState.READY:
            raise ControlError(409, f"group {name} is {g.status.state.value}, not Ready")
        pids = self.backend.pids(handle)
        if body.target == "expert":
            candidates = [m for m in pids if m.size > 1 and m.rank > 0]
        else:
            candidates = [m for m in pids if m.role == body.target]
        if not candidates:
            raise ControlError(404, f"group {name} has no {body.target} member to kill")
        member: Member = sorted(candidates, key=lambda m: (m.instance, m.rank))[0]
        pid, gone = self.backend.kill_member(handle, member)
        self.store.event("kill", f"group {name}: SIGKILL {member.role}/{member.instance}/{member.rank} pid {pid}"
                                 f"{'' if gone else ' (still alive!)'}")
        return Killed(member=f"{member.role}/{member.instance}/{member.rank}", pid=pid, handle=handle.id,
                      pids_before=sorted(pids.values()), landed=gone)

    def scale_pool(self, body: ScalePool) -> ScaleResult:
        with self._lock:
            pool = self._pool(body.template, body.bounds, body.warm_pool)
            return self._scale(pool, body.target, body.floor)

    def _pool(self, template: InferenceGroup, bounds: Bounds, warm_pool: int) -> WarmPool:
        """The warm pool of `template` (its groups are <name>-<i>: a restarted controller finds them again)."""
        pool = self.pools.get(template.name)
        if pool is None or pool.template != template or pool.bounds != bounds:
            pool = self.pools[template.name] = WarmPool(self.manager, template, bounds, warm_pool)
        pool.warm_pool = warm_pool
        return pool

    def _scale(self, pool: WarmPool, target: int, floor: int | None) -> ScaleResult:
        """scale_to, then the pool's groups written back as desired state (caller holds the lock)."""
        result = pool.scale_to(target, floor)
        for g in pool.groups():
            if g.spec.name in result.stopped or g.status.state in _GONE:
                self.store.delete_group(g.spec.name)
            else:
                self._sync_desired(g)
        if result.changed:
            self.store.event("scale", f"pool {pool.template.name} -> {result.target}: serving {result.serving}, "
                                      f"standby {result.standby}, activated {result.activated}, parked {result.parked}, "
                                      f"cold-started {result.cold_started}, stopped {result.stopped}")
        return result

    # -- the autoscaler policy, kept running by the controller ------------------------------------------
    def start_autoscaler(self, body: AutoscalerBody, record: bool = True) -> AutoscalerView:
        name = body.template.name
        with self._lock:
            self.stop_autoscaler(name, forget=False)
            pool = self._pool(body.template, body.policy.bounds, body.policy.warm_pool)
            observer = SetObserver(self.router_url, self.client_key, self._member_key,
                                   lambda: [m.endpoint for g in pool.serving() for m in g.status.members if m.endpoint])
            scaler = Autoscaler(_LockedPool(self, pool), body.policy,
                                observe=observer if body.policy.metrics else None).start()
            self.autoscalers[name] = (scaler, observer)
            if record:
                self.store.put_autoscaler(name, body.model_dump_json())
                self.store.event("autoscaler", f"started over pool {name} (tick {body.policy.tick_s:g}s)")
            return self.autoscaler_view(name)

    def stop_autoscaler(self, name: str, forget: bool = True) -> bool:
        running = self.autoscalers.pop(name, None)
        if running is not None:
            running[0].stop()
            running[1].close()
        known = self.store.delete_autoscaler(name) if forget else False
        if forget and (running or known):
            self.store.event("autoscaler", f"stopped over pool {name}")
        return running is not None or known

    def autoscaler_view(self, name: str) -> AutoscalerView:
        if name not in self.autoscalers:
            raise ControlError(404, f"no autoscaler over pool {name!r}")
        scaler = self.autoscalers[name][0]
        events = list(scaler.events)
        return AutoscalerView(name=name, policy=scaler.policy, decisions=sum(1 for e in events if e.result is not None),
                              last=[e.model_dump(mode="json") for e in events[-20:]])

    def _sync_desired(self, g: ManagedGroup) -> None:
        self.store.put_group(DesiredGroup(spec=g.spec, weight=g.weight, standby=g.standby))

    def _group(self, name: str) -> ManagedGroup:
        g = self.manager.groups.get(name)
        if g is None:
            raise ControlError(404, f"no group named {name!r}")
        return g

    # -- observation -------------------------------------------------------------------------------
    def view(self, name: str) -> GroupView:
        g = self._group(name)
        s = g.status
        pids = {}
        if s.handle is not None:
            try:
                pids = self.backend.pids(s.handle)
            except BackendError:
                pids = {}  # the build just ended: no member to name
        by_place = {(m.role, m.instance, m.rank): p for m, p in pids.items()}
        members = [MemberView(role=m.role, instance=m.instance, rank=m.rank, endpoint=m.endpoint, phase=m.phase.value,
                              pid=by_place.get((m.role, m.instance, m.rank))) for m in s.members]
        return GroupView(name=s.name, version=s.version, state=s.state, weight=g.weight, standby=g.standby,
                         restarts=s.restarts, handle=s.handle.id if s.handle else None,
                         message=s.events[-1].message if s.events else "", last_activation_s=s.last_activation_s,
                         members=members)

    def status(self) -> FleetStatus:
        with self._lock:
            names = sorted(self.manager.groups)
        canary = self.store.canary()
        return FleetStatus(router_url=self.router_url, router_pid=self.router.pid if self.router else None,
                           router_replicas=self.routes.replicas(), controller_pid=os.getpid(), groups=[self.view(n) for n in names],
                           canary=CanaryRecord.model_validate_json(canary) if canary else None)

    def record_canary(self, record: CanaryRecord) -> CanaryRecord:
        record = record.model_copy(update={"at": time.time()})
        self.store.put_canary(record.model_dump_json())
        what = record.decision or f"step {record.step} at {record.percent:g} %"
        self.store.event("canary", f"{record.canary} over {record.stable}: {what} {record.reason}".strip())
        return record

    def member_metrics(self) -> list[str]:
        """Prometheus expositions of every routed member (the canary's direct source reads them)."""
        with bearer_client(self._member_key) as c:
            return scrape_members(c, self.routes.groups())

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self, stop_fleet: bool, drain_s: float = 5.0) -> None:
        """Stop reconciling. `stop_fleet`: also stop every group and the router and forget desired state
        (`tideflow down`); otherwise they keep serving for the next controller to adopt."""
        self._stop.set()
        self.routes.close()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        for name in list(self.autoscalers):
            self.stop_autoscaler(name, forget=stop_fleet)
        if stop_fleet:
            with self._lock:
                for name in self.store.groups():
                    self.store.delete_group(name)
                if self.manager is not None:
                    self.manager.shutdown(drain_s)
                for t in self._stoppers.values():
                    t.join(timeout=drain_s + 30)
                if self.router is not None:
                    self.router.stop()
                _stop_leftovers(self.store)
                self.store.event("down", "every group and the router stopped")


class _LockedPool:
    """What the autoscaler scales: the controller's pool, each step under the controller's lock and
    written back as desired state, exactly as an API call would do it."""

    def __init__(self, controller: Controller, pool: WarmPool) -> None:
        self.controller, self.pool = controller, pool

    def capacity(self) -> int:
        return self.pool.capacity()

    def scale_to(self, n: int, floor: int | None = None) -> ScaleResult:
        with self.controller._lock:
            return self.controller._scale(self.pool, n, floor)


def router_env(store: Store) -> dict[str, str]:
    """The keys a router replica needs: clients', its admin API's, the members', and the route set's."""
    return {"TIDEFLOW_API_KEYS": store.secret("router_client"), ADMIN_KEYS_ENV: store.secret("router_admin"),
            UPSTREAM_KEY_ENV: store.secret("member"), ROUTES_KEY_ENV: store.secret("routes")}


def _keep_port(store: Store, host: str, asked: int) -> int:
    """`asked`, else the port this controller had (when still free), else a free one; recorded for the next start."""
    had = store.setting("controller_port")
    port = asked or (int(had) if had and port_free(host, int(had)) else free_port(host))
    store.set_setting("controller_port", str(port))
    return port


def _shape(spec: InferenceGroup) -> str:
    """What makes two groups interchangeable: everything but the name (pool copies differ only by it)."""
    return spec.model_copy(update={"name": "_", "warm_pool": 0}).model_dump_json()


def _by_handle(records: list[MemberRecord]) -> dict[str, list[MemberRecord]]:
    out: dict[str, list[MemberRecord]] = defaultdict(list)
    for rec in records:
        out[rec.handle_id].append(rec)
    return out


def _reap(store: Store, recs: list[MemberRecord]) -> int:
    """Stop the recorded members that are still the same processes; forget the build. Returns how many ran."""
    stopped = 0
    for rec in recs:
        proc = adopt(rec.handle_id, rec.pid, rec.ticks, Path(rec.log_path))
        if proc is not None:
            proc.stop(grace_s=2.0)
            stopped += 1
    store.forget(recs[0].handle_id)
    store.event("reap", f"stopped {stopped} leftover members of {recs[0].group} ({recs[0].handle_id})")
    return stopped


def _stop_leftovers(store: Store) -> int:
    """Every recorded member and the recorded router, when still running; the records are cleared."""
    stopped = sum(_reap(store, recs) for recs in _by_handle(store.members()).values())
    rec = store.router()
    if rec is not None:
        proc = adopt("router", rec.pid, rec.ticks, Path(rec.log_path))
        if proc is not None:
            proc.stop()
            stopped += 1
        store.set_router(None)
    return stopped


def stop_recorded_fleet() -> int:
    """`tideflow down` when no controller answers: stop what the last one recorded, forget desired state."""
    store = Store(home() / "controller.db")
    try:
        for name in store.groups():
            store.delete_group(name)
        stopped = _stop_leftovers(store)
        store.event("down", f"no controller answered; {stopped} recorded processes stopped")
        return stopped
    finally:
        store.close()
