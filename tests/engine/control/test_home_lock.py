"""One local controller per TIDEFLOW_HOME: two `tideflow controller` processes started together on one home (as a
double-clicked UI or two shells do) used to both pass the look for a registered controller, which registers
only once it has started, and both adopted and stopped the same members. Now one runs and the other exits
with one line naming it."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from engine.control.home_lock import HomeLock, HomeLocked
from engine.control.local_runtime import stop_recorded_fleet
from engine.runtime.process import Child, free_port, tideflow_argv
from tests.conftest import assert_nothing_left

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_two_controllers_started_at_once_on_one_home_leave_one_running(tideflow_home, tiny_model_dir):
    ports = [free_port(), free_port()]
    children = [Child(f"controller-{i}", tideflow_argv("controller", "--port", str(port), "--model-dir",
                                                          str(tiny_model_dir)),
                      tideflow_home / "logs" / f"controller-{i}.log") for i, port in enumerate(ports)]
    try:
        deadline = time.monotonic() + 60
        while all(c.alive() for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = [c for c in children if not c.alive()]
        assert len(refused) == 1, [c.log_tail() for c in children]
        running = next(c for c in children if c.alive())
        assert refused[0].returncode == 2  # the CLI's exit status for a refused call
        lines = [line for line in refused[0].log_tail().splitlines() if line.strip()]
        assert len(lines) == 1 and "a controller already runs on" in lines[0], lines
        assert f"pid {running.pid}" in lines[0], lines
        down = subprocess.run(tideflow_argv("down"), capture_output=True, text=True, timeout=180)
        assert down.returncode == 0, down.stderr
    finally:
        for c in children:
            c.stop(grace_s=30)
        stop_recorded_fleet()
    assert_nothing_left(tideflow_home)


def test_the_lock_goes_with_its_holder(tmp_path):
    first = HomeLock(tmp_path / "controller.lock")
    try:
        HomeLock(tmp_path / "controller.lock")
    except HomeLocked as exc:
        assert f"pid {os.getpid()}," in str(exc), str(exc)
    else:
        raise AssertionError("a second lock on one home was granted")
    first.release()
    HomeLock(tmp_path / "controller.lock").release()  # released: the next controller takes it
