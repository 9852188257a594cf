"""The local runtime: members and the router replicas are processes on this machine, desired state is SQLite.

Processes run in sessions of their own, so killing the controller stops no request; the process
ledger (pid + start time + port) lets a restarted controller re-adopt them instead of starting
duplicates, and what it cannot adopt it stops and rebuilds whole.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from pathlib import Path

from engine.control.keys import CLIENT_FILE, MEMBERS_FILE, ROUTES_FILE, UPSTREAM_FILE
from engine.control.router_replicas import RouterReplicas, RouterSettings, stop_recorded_routers
from engine.control.runtime import ControllerConfig, Runtime
from engine.control.store import Store, effective_groups
from engine.group.backend import BackendError
from engine.group.local import LocalProcessBackend, MemberRecord
from engine.group.manager import GroupManager
from engine.runtime.paths import home
from engine.runtime.pki import FleetCA, fleet_identities
from engine.runtime.process import adopt, free_port, port_free
from engine.runtime.tls import TlsIdentity
from engine.router.app import ADMIN_KEYS_ENV, UPSTREAM_KEY_ENV
from engine.router.sync import ROUTES_KEY_ENV
from engine.api.auth import API_KEY_FILE_ENV


RENEW_CHECK_S = 30.0  # how often the fleet's certificates are looked at for renewal (a tenth of their life if less)


class LocalRuntime(Runtime):
    def __init__(self, config: ControllerConfig, store: Store | None = None) -> None:
        self.config = config
        self.store = store or Store(home() / "controller.db")
        self.port = _keep_port(self.store, config.host, config.port)  # the URL an adopted router watches
        self.ca, identities = _fleet_tls(config)
        scheme = "https" if self.ca else "http"
        self.url = f"{scheme}://{config.host}:{self.port}"
        self._renew_at = 0.0
        self.store.set_setting("model_dir", str(config.model_dir))  # what `tideflow router-replica` serves with
        self.store.set_setting("model_name", config.model_name)
        # what members verify is the key file the controller's key book writes (a rotation reaches them there); what
        # this backend sends them is the store's key as each call goes
        self.backend = LocalProcessBackend(config.model_dir, lambda: self.store.secret("member"), config.model_name,
                                           home() / "logs", config.host, ledger=self.store,
                                           capacity=config.capacity_check, key_file=home() / "keys" / MEMBERS_FILE,
                                           identity=identities.get("member"))
        router_identity = identities.get("router")
        self.routers = RouterReplicas(RouterSettings(
            host=config.host, port=config.router_port, replicas=config.router_replicas, model_name=config.model_name,
            model_dir=config.model_dir, controller_url=self.url, args=config.router_args, scheme=scheme,
            env={**router_env(self.store), **(router_identity.env() if router_identity else {})}), self.store)

    @property
    def router_url(self) -> str:  # type: ignore[override]
        return self.routers.url

    def ensure_router(self) -> list[int]:
        return self.routers.ensure()

    def renew_certificates(self) -> list[str]:
        if self.ca is None or time.monotonic() < self._renew_at:
            return []
        self._renew_at = time.monotonic() + min(RENEW_CHECK_S, self.config.cert_lifetime_h * 3600 / 10)
        renewed = self.ca.renew_due()
        if renewed:
            self.store.event("tls", f"certificates issued again before expiry: {', '.join(renewed)}")
        return renewed

    def router_pids(self) -> list[int]:
        return self.routers.pids()

    def kill_router(self) -> tuple[str, bool]:
        return self.routers.kill_one()

    def adopt(self, manager: GroupManager) -> list[str]:
        adopted = []
        desired = effective_groups(self.store)
        by_group: dict[str, list[list[MemberRecord]]] = defaultdict(list)
        for recs in _by_handle(self.store.members()).values():
            by_group[recs[0].group].append(recs)
        for name, builds in by_group.items():
            want = desired.get(name)
            keep = builds[-1] if want is not None and len(builds) == 1 else None
            for recs in builds:
                if recs is not keep:  # not wanted any more, or two builds of one group: none may stay twice
                    _reap(self.store, recs)
            if keep is None:
                continue
            try:
                handle = self.backend.adopt(want.spec, keep, standby=want.standby)
            except BackendError as exc:
                self.store.event("adopt", f"group {name}: {exc}; rebuilding it whole")
                continue
            manager.up(want.spec, standby=want.standby, weight=want.weight, adopted=handle)
            adopted.append(name)
            self.store.event("adopt", f"group {name}: adopted {len(keep)} running members")
        return adopted

    def stop_leftovers(self) -> int:
        return self.routers.stop() + _stop_leftovers(self.store)


def _fleet_tls(config: ControllerConfig) -> tuple[FleetCA | None, dict[str, TlsIdentity]]:
    """With TLS on: the fleet CA of this home (made on first use) and the certificates of the controller (its
    own, in its environment), the routers and the members, one per role, valid for the bind address."""
    if not config.tls_on:
        return None, {}
    return fleet_identities(home() / "tls", dt.timedelta(hours=config.cert_lifetime_h), config.host,
                            ("controller", "router", "member"), own="controller")


def router_env(store: Store) -> dict[str, str]:
    """The keys a router replica needs: clients' (digests, in a file it reads again when the controller rotates
    the key), its admin API's, the members' and the route set's (files too)."""
    keys = home() / "keys"
    return {API_KEY_FILE_ENV: str(keys / CLIENT_FILE), ADMIN_KEYS_ENV: store.secret("router_admin"),
            UPSTREAM_KEY_ENV + "_FILE": str(keys / UPSTREAM_FILE), ROUTES_KEY_ENV + "_FILE": str(keys / ROUTES_FILE)}


def _keep_port(store: Store, host: str, asked: int, reclaim_s: float = 15.0) -> int:
    """`asked`, else the port this controller had, else a free one; recorded for the next start.

    The port it had is waited for up to `reclaim_s` while a controller that was just killed lets it go: a
    new port would change the URL every adopted router watches, and they would be replaced."""
    had = int(store.setting("controller_port") or 0)
    port = asked
    if not port and had:
        deadline = time.monotonic() + reclaim_s
        while not port_free(host, had) and time.monotonic() < deadline:
            time.sleep(0.1)
        if port_free(host, had):
            port = had
        else:
            store.event("controller", f"port {had} is still taken after {reclaim_s:g}s; taking another one "
                                      "(routers watching the old URL are replaced)")
    port = port or free_port(host)
    store.set_setting("controller_port", str(port))
    return port


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
    """Every recorded member and router replica, when still running; the records are cleared."""
    return sum(_reap(store, recs) for recs in _by_handle(store.members()).values()) + stop_recorded_routers(store)


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
