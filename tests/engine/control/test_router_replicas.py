"""A home from before router replicas: its one router record is taken over as replica 0, and since that router
did not bind with SO_REUSEPORT (no replica could share its port), a restarted controller stops it instead of
adopting it. (Replicas killed and started again, and adopted across a controller restart, are tested on a real
controller in test_controller.py.)"""

from __future__ import annotations

import sqlite3
import sys

import pytest

from engine.control.router_replicas import RouterReplicas, RouterSettings
from engine.control.store import RouterRecord, Store
from engine.runtime.process import Child

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_a_single_router_record_becomes_replica_0_and_is_replaced_not_adopted(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    old = Child("old-router", [sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "old.log")
    try:
        legacy = RouterRecord(pid=old.pid, ticks=old.start_ticks, port=40123, log_path=str(old.log_path),
                              controller_url="http://127.0.0.1:1")
        db = sqlite3.connect(tmp_path / "controller.db")
        db.execute("CREATE TABLE routers (id INTEGER PRIMARY KEY CHECK (id = 1), body TEXT NOT NULL)")
        db.execute("INSERT INTO routers VALUES (1, ?)", (legacy.model_dump_json(),))
        db.commit()
        db.close()

        store = Store(tmp_path / "controller.db")
        assert store.routers() == {0: legacy} and legacy.reuse_port is False
        assert not sqlite3.connect(tmp_path / "controller.db").execute(
            "SELECT name FROM sqlite_master WHERE name = 'routers'").fetchall()

        replicas = RouterReplicas(RouterSettings(host="127.0.0.1", port=0, replicas=2, model_name="default",
                                                 model_dir=tmp_path, controller_url="http://127.0.0.1:1", env={}), store)
        replicas._adopt()
        assert old.proc.wait(timeout=30) is not None  # stopped: it could not share its port with a second replica
        assert store.routers() == {} and replicas.port == 40123  # its port is kept: clients need no new address
        assert any("cannot serve as replica 0" in e.message for e in store.events())
    finally:
        old.stop()
