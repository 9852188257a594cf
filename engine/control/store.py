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
CREATE TABLE IF NOT EXISTS desired (name TEXT PRIMARY KEY, spec TEXT NOT NULL, weight REAL NOT NULL,
                                    standby INTEGER NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS members (handle_id TEXT NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS members_handle ON members (handle_id);
CREATE TABLE IF NOT EXISTS routers (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS autoscalers (name TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS canary (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (at REAL NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL);
"""


class DesiredGroup(BaseModel):
    """One group as the user wants it."""

    spec: InferenceGroup
    weight: float = Field(ge=0, description="router weight while serving")
    standby: bool = Field(False, description="loaded and warm but not routed (the warm pool)")


class RouterRecord(BaseModel):
    """The router process the controller started, and the controller URL it watches."""

    pid: int
    ticks: int
    port: int
    log_path: str
    controller_url: str


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

    def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- desired groups --------------------------------------------------------------------------
    def put_group(self, desired: DesiredGroup) -> None:
        self._run("INSERT OR REPLACE INTO desired VALUES (?, ?, ?, ?, ?)",
                  (desired.spec.name, desired.spec.model_dump_json(), desired.weight, int(desired.standby), time.time()))

    def delete_group(self, name: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM desired WHERE name = ?", (name,)).rowcount > 0

    def groups(self) -> dict[str, DesiredGroup]:
        rows = self._run("SELECT spec, weight, standby FROM desired ORDER BY name")
        out = {}
        for spec, weight, standby in rows:
            g = DesiredGroup(spec=InferenceGroup.model_validate_json(spec), weight=weight, standby=bool(standby))
            out[g.spec.name] = g
        return out

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

    def set_router(self, rec: RouterRecord | None) -> None:
        if rec is None:
            self._run("DELETE FROM routers")
        else:
            self._run("INSERT OR REPLACE INTO routers VALUES (1, ?)", (rec.model_dump_json(),))

    def router(self) -> RouterRecord | None:
        rows = self._run("SELECT body FROM routers")
        return RouterRecord.model_validate_json(rows[0][0]) if rows else None

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

    def event(self, kind: str, message: str) -> None:
        self._run("INSERT INTO events VALUES (?, ?, ?)", (time.time(), kind, message))

    def events(self, limit: int = 200) -> list[Event]:
        rows = self._run("SELECT at, kind, message FROM events ORDER BY at DESC LIMIT ?", (limit,))
        return [Event(at=a, kind=k, message=m) for a, k, m in reversed(rows)]

    def close(self) -> None:
        with self._lock:
            self._db.close()
