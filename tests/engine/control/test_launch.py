"""What `tideflow ui` and `tideflow release` start, they stop, and nothing else: a controller started by hand
after theirs died keeps serving. A SIGTERMed controller leaves no registration behind."""

from __future__ import annotations

import signal

import pytest

from engine.control import discovery
from engine.control.client import ControlClient
from engine.control.launch import ensure_controller, stop_controller
from engine.control.local_runtime import stop_recorded_fleet
from engine.runtime.process import free_port, start_service, start_ticks, tideflow_argv

from tests.conftest import assert_nothing_left

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


@pytest.fixture
def home(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    yield tmp_path
    stop_recorded_fleet()
    assert_nothing_left(tmp_path)


def _hand_started(home, model_dir):
    port = free_port()
    return start_service("controller-by-hand", tideflow_argv("controller", "--port", str(port), "--model-dir",
                                                             str(model_dir)),
                         home / "logs" / "by-hand.log", f"http://127.0.0.1:{port}/health", timeout_s=120)


def test_stopping_what_was_started_leaves_a_hand_started_controller_serving(home, tiny_model_dir):
    ours = ensure_controller()
    assert ours is not None and discovery.find().pid == ours.pid
    ours.kill(signal.SIGKILL)  # the UI's controller dies ...
    ours.proc.wait(timeout=30)
    by_hand = _hand_started(home, tiny_model_dir)  # ... and an operator starts one by hand
    try:
        said = stop_controller(ours)  # the UI is stopped
        assert "keeps serving" in said and str(by_hand.pid) in said
        assert by_hand.alive()
        info = discovery.find()
        assert info.pid == by_hand.pid
        with ControlClient(info.url, info.admin_key) as client:
            assert client.health() and client.status().router_pids  # its routers still run
    finally:
        with ControlClient.connect() as client:
            client.down()
        by_hand.stop(grace_s=60)


def test_stopping_its_own_controller_stops_its_fleet(home):
    ours = ensure_controller()
    router_pids = ControlClient.connect().status().router_pids
    said = stop_controller(ours)
    assert "stopped the controller started here" in said
    assert not ours.alive() and router_pids and all(start_ticks(pid) is None for pid in router_pids)
    with pytest.raises(discovery.NoController):
        discovery.find()


def test_a_sigtermed_controller_unregisters_itself(home, tiny_model_dir):
    controller = _hand_started(home, tiny_model_dir)
    try:
        assert discovery.info_path().exists()
        controller.proc.send_signal(signal.SIGTERM)
        assert controller.proc.wait(timeout=60) == 0
        assert not discovery.info_path().exists()
    finally:
        controller.stop()
