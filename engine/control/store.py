"""Durable desired state of the local backend: SQLite in $TIDEFLOW_HOME, one file, mode 0600.

Desired state is what users asked for (group specs, weights, serving or standby); the process
ledger is what the controller started (pid + start time + port), so a restarted controller can
re-adopt it instead of starting duplicates. Observed state (alive, Ready) is never stored: it is
read again from the processes each time. Secrets (admin, member, client keys) live here too,
which is why the file is 0600.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, Field

from engine.group.local import MemberRecord
from engine.group.spec import InferenceGroup

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (name TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS desired (name TEXT PRIMARY KEY, spec TEXT NOT NULL, weight REAL NOT NULL,
                                    standby INTEGER NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS members (handle_id TEXT NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS members_handle ON members (handle_id);
CREATE TABLE IF NOT EXISTS router_replicas (slot INTEGER PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS autoscalers (name TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS canary (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (at REAL NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
"""


class DesiredGroup(BaseModel):
    """One group as the user wants it: written only by user verbs (apply, delete, weights, activate, park, a
    pool's scale), never by the controller's own decisions (those are GroupDecisions)."""

    spec: InferenceGroup
    weight: float = Field(ge=0, description="router weight while serving")
    standby: bool = Field(False, description="loaded and warm but not routed (the warm pool)")


class GroupDecision(BaseModel):
    """What the controller decided for a group on its own, over what the user asked: a warm replacement serves
    a standby in a fallen group's place and rebuilds the fallen one into the pool. Kept apart from the spec so
    the spec stays what the user wrote (a later user verb on the group supersedes it), and durable so a
    restarted controller keeps it."""

    standby: bool
    weight: float = Field(ge=0)
    reason: str = Field(description="why, in a sentence (shown by status)")
    at: float = Field(description="unix time of the decision")


def effective(desired: DesiredGroup, decision: GroupDecision | None) -> DesiredGroup:
    """What the controller converges the group to: the spec, with the controller's decision over it."""
    if decision is None:
        return desired
    return desired.model_copy(update={"standby": decision.standby, "weight": decision.weight})


def effective_groups(store: "StateStore") -> dict[str, DesiredGroup]:
    """Every desired group as the controller runs it (a restarted controller adopts and builds these)."""
    decisions = store.decisions()
    return {name: effective(want, decisions.get(name)) for name, want in store.groups().items()}


class RouterRecord(BaseModel):
    """A router replica the controller started, and the controller URL it watches."""

    pid: int
    ticks: int
    port: int
    log_path: str
    controller_url: str
    reuse_port: bool = Field(False, description="bound with SO_REUSEPORT: other replicas may share its port "
                                                "(a record of a router from before replicas has False)")


class Event(BaseModel):
    at: float
    kind: str
    message: str


class StateStore(Protocol):
    """What the controller keeps durable, on any runtime: desired groups, autoscaler policies, the last
    canary, small settings, events, and the keys of the fleet."""

    def put_group(self, desired: DesiredGroup) -> None: ...

    def delete_group(self, name: str) -> bool: ...

    def groups(self) -> dict[str, DesiredGroup]: ...

    def put_decision(self, name: str, decision: GroupDecision | None) -> None: ...

    def decisions(self) -> dict[str, GroupDecision]: ...

    def put_autoscaler(self, name: str, body_json: str) -> None: ...

    def delete_autoscaler(self, name: str) -> bool: ...

    def autoscalers(self) -> dict[str, str]: ...

    def put_canary(self, body_json: str) -> None: ...

    def canary(self) -> str | None: ...

    def put_lease(self, body_json: str | None) -> None: ...

    def lease(self) -> str | None: ...

    def secret(self, name: str) -> str: ...

    def event(self, kind: str, message: str) -> None: ...

    def events(self, limit: int = 200) -> list[Event]: ...

    def close(self) -> None: ...


class Store:
    """The local runtime's StateStore, plus its process ledger and router record. Thread-safe: one
    connection, one lock (the controller's writes are few and small)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._take_single_router_record()

    def _take_single_router_record(self) -> None:
        """A home written before router replicas kept its one router in `routers`: it becomes replica 0."""
        if self._run("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'routers'"):
            self._run("INSERT OR IGNORE INTO router_replicas SELECT 0, body FROM routers")
            self._run("DROP TABLE routers")

    def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- desired groups --------------------------------------------------------------------------
    def put_group(self, desired: DesiredGroup) -> None:
        self._run("INSERT OR REPLACE INTO desired VALUES (?, ?, ?, ?, ?)",
                  (desired.spec.name, desired.spec.model_dump_json(), desired.weight, int(desired.standby), time.time()))

    def delete_group(self, name: str) -> bool:
        with self._lock:
            self._db.execute("DELETE FROM decisions WHERE name = ?", (name,))
            return self._db.execute("DELETE FROM desired WHERE name = ?", (name,)).rowcount > 0

    def groups(self) -> dict[str, DesiredGroup]:
        rows = self._run("SELECT spec, weight, standby FROM desired ORDER BY name")
        out = {}
        for spec, weight, standby in rows:
            g = DesiredGroup(spec=InferenceGroup.model_validate_json(spec), weight=weight, standby=bool(standby))
            out[g.spec.name] = g
        return out

    # -- the controller's own decisions over the specs -----------------------------------------------
    def put_decision(self, name: str, decision: GroupDecision | None) -> None:
        if decision is None:
            self._run("DELETE FROM decisions WHERE name = ?", (name,))
        else:
            self._run("INSERT OR REPLACE INTO decisions VALUES (?, ?)", (name, decision.model_dump_json()))

    def decisions(self) -> dict[str, GroupDecision]:
        return {name: GroupDecision.model_validate_json(body)
                for name, body in self._run("SELECT name, body FROM decisions ORDER BY name")}

    # -- autoscaler policies (desired: running until stopped) ---------------------------------------
    def put_autoscaler(self, name: str, body_json: str) -> None:
        self._run("INSERT OR REPLACE INTO autoscalers VALUES (?, ?)", (name, body_json))

    def delete_autoscaler(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM autoscalers WHERE name = ?", (name,)).rowcount > 0

    def autoscalers(self) -> dict[str, str]:
        return dict(self._run("SELECT name, body FROM autoscalers ORDER BY name"))

    # -- process ledger (ProcessLedger of the local backend) ------------------------------------
    def record(self, rec: MemberRecord) -> None:
        self._run("INSERT INTO members VALUES (?, ?)", (rec.handle_id, rec.model_dump_json()))

    def forget(self, handle_id: str) -> None:
        self._run("DELETE FROM members WHERE handle_id = ?", (handle_id,))

    def members(self) -> list[MemberRecord]:
        return [MemberRecord.model_validate_json(r) for (r,) in self._run("SELECT record FROM members")]

    def set_router(self, slot: int, rec: RouterRecord | None) -> None:
        if rec is None:
            self._run("DELETE FROM router_replicas WHERE slot = ?", (slot,))
        else:
            self._run("INSERT OR REPLACE INTO router_replicas VALUES (?, ?)", (slot, rec.model_dump_json()))

    def routers(self) -> dict[int, RouterRecord]:
        """Router replicas by slot (0, 1, ...)."""
        rows = self._run("SELECT slot, body FROM router_replicas ORDER BY slot")
        return {slot: RouterRecord.model_validate_json(body) for slot, body in rows}

    # -- settings that must survive a restart (the controller's port: its router watches that URL) ----------
    def setting(self, name: str) -> str | None:
        rows = self._run("SELECT value FROM settings WHERE name = ?", (name,))
        return rows[0][0] if rows else None

    def set_setting(self, name: str, value: str) -> None:
        self._run("INSERT OR REPLACE INTO settings VALUES (?, ?)", (name, value))

    # -- the latest canary ------------------------------------------------------------------------------
    def put_canary(self, body_json: str) -> None:
        self._run("INSERT OR REPLACE INTO canary VALUES (1, ?)", (body_json,))

    def canary(self) -> str | None:
        rows = self._run("SELECT body FROM canary")
        return rows[0][0] if rows else None

    # -- the fleet lease (one changing flow run at a time) ---------------------------------------------------
    def put_lease(self, body_json: str | None) -> None:
        if body_json is None:
            self._run("DELETE FROM settings WHERE name = 'lease'")
        else:
            self.set_setting("lease", body_json)

    def lease(self) -> str | None:
        return self.setting("lease")

    # -- secrets and events -----------------------------------------------------------------------
    def secret(self, name: str) -> str:
        """The named key, generated on first use and kept: adopted processes still expect the old one."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO secrets VALUES (?, ?)", (name, secrets.token_urlsafe(24)))
            return self._db.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0]

    def set_secret(self, name: str, value: str) -> None:
        """Replace the named key (a rotation: engine.control.keys)."""
        self._run("INSERT OR REPLACE INTO secrets VALUES (?, ?)", (name, value))

    def event(self, kind: str, message: str) -> None:
        self._run("INSERT INTO events VALUES (?, ?, ?)", (time.time(), kind, message))

    def events(self, limit: int = 200) -> list[Event]:
        rows = self._run("SELECT at, kind, message FROM events ORDER BY at DESC LIMIT ?", (limit,))
        return [Event(at=a, kind=k, message=m) for a, k, m in reversed(rows)]

    def close(self) -> None:
        with self._lock:
            self._db.close()
