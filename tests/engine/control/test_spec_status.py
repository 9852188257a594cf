"""Spec apart from status (issue #38 item 1): the controller's own decisions never rewrite what the user asked,
reconcile converges serving/standby every pass (a failed park is tried again), and each group's conditions
say what is wrong and since when. In process over a backend that runs nothing (fake_fleet.py)."""

from __future__ import annotations

import time

import pytest

from engine.control.controller import ControlError
from engine.control.models import ApplyGroup
from engine.group.manager import GroupState
from engine.group.switch import MemberSwitchError
from tests.engine.control.fake_fleet import QuietSwitch, group_spec, table_controller
from tests.engine.control.test_control_races import serving, until, wait_state


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    controllers = []

    def start():
        controllers.append(table_controller(tmp_path, tmp_path / "model"))
        return controllers[-1]

    try:
        yield start
    finally:
        for controller, _ in controllers[:-1]:
            controller.close(stop_fleet=False)
            controller.store.close()
        controller, _ = controllers[-1]
        controller.close(stop_fleet=True, drain_s=0.1)
        controller.store.close()


def condition(controller, name: str, kind: str):
    (found,) = [c for c in controller.view(name).conditions if c.type == kind]
    return found


def test_a_warm_replacement_is_a_decision_beside_the_spec_and_outlives_a_restart(fleet):
    """The fallen group used to be written back into desired state as standby, and the standby as serving: the
    spec no longer said what the user asked."""
    controller, backend = fleet()
    serving(controller, "main")
    serving(controller, "spare", standby=True)
    backend.fall("main")
    assert until(lambda: controller.manager.groups["spare"].status.state == GroupState.READY)
    assert wait_state(controller, "main", {GroupState.STANDBY}) == GroupState.STANDBY

    spec = controller.store.groups()
    assert (spec["main"].standby, spec["spare"].standby) == (False, True)  # as the user applied them
    decisions = controller.store.decisions()
    assert (decisions["main"].standby, decisions["spare"].standby) == (True, False)
    assert "fell" in decisions["main"].reason and "in place of main" in decisions["spare"].reason
    view = controller.view("main")
    assert view.desired.standby is False and view.standby is True and view.decision.standby is True

    controller.close(stop_fleet=False)  # a restarted controller builds what was decided, not the bare spec
    again, _ = fleet()
    again.reconcile()
    assert wait_state(again, "spare", {GroupState.READY, GroupState.FAILED}) == GroupState.READY
    assert wait_state(again, "main", {GroupState.STANDBY, GroupState.FAILED}) == GroupState.STANDBY

    again.apply(ApplyGroup(spec=group_spec("main"), weight=1.0, standby=False))  # the user's word supersedes it
    assert "main" not in again.store.decisions()
    assert again.manager.groups["main"].status.state == GroupState.READY


class FailingPark(QuietSwitch):
    def __init__(self, failures: int) -> None:
        self.failures = failures

    def park(self, urls: list[str], drain_s: float) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise MemberSwitchError("a member would not drain")


def test_a_park_that_failed_is_tried_again_until_the_group_runs_as_desired(fleet):
    """Before, a failed park left the group serving against its spec for ever: reconcile converged existence only."""
    controller, _ = fleet()
    serving(controller, "drift")
    controller.manager.switch = switch = FailingPark(failures=2)
    controller.manager.groups["drift"].switch = switch
    with pytest.raises(ControlError, match="park failed"):
        controller.apply(ApplyGroup(spec=group_spec("drift"), weight=1.0, standby=True))
    assert controller.store.groups()["drift"].standby is True  # what the user asked stays asked
    controller.reconcile()  # a converge thread parks it (and fails once more): it may already be Draining
    assert condition(controller, "drift", "Converged").reason in ("Parking", "ConvergeFailed", "NotSettled")
    deadline = time.monotonic() + 20
    seen_failed = False
    while controller.manager.groups["drift"].status.state != GroupState.STANDBY:
        assert time.monotonic() < deadline, controller.store.events()[-5:]
        controller.reconcile()
        seen_failed = seen_failed or condition(controller, "drift", "Converged").reason == "ConvergeFailed"
        time.sleep(0.05)
    controller.reconcile()
    assert seen_failed and switch.failures == 0
    assert condition(controller, "drift", "Converged").status == "True"
    assert any(e.kind == "converge" and "parked to match" in e.message for e in controller.store.events())


def test_conditions_say_what_is_wrong_and_since_when(fleet):
    controller, backend = fleet()
    backend.refuse["down"] = 4  # every build of it fails: it gives up
    controller.apply(ApplyGroup(spec=group_spec("down"), weight=1.0))
    assert wait_state(controller, "down", {GroupState.FAILED}) == GroupState.FAILED
    backend.refuse["down"] = 100  # and the substrate keeps refusing for now
    controller.config.policy = controller.config.policy.model_copy(update={"backoff_max_s": 3.0})  # first retry in 3 s
    controller.reconcile()
    failed = condition(controller, "down", "Failed")
    assert (failed.status, failed.reason) == ("True", "GaveUp") and "refused" in failed.message
    assert "built again in 3s" in failed.message
    assert condition(controller, "down", "Available").status == "False"
    time.sleep(1.1)
    controller.reconcile()
    assert condition(controller, "down", "Failed").last_transition_time == failed.last_transition_time  # since then

    backend.refuse["down"] = 0  # the substrate answers again: the retry builds it
    deadline = time.monotonic() + 20
    while controller.manager.groups["down"].status.state != GroupState.READY:
        assert time.monotonic() < deadline
        controller.reconcile()
        time.sleep(0.05)
    controller.reconcile()
    assert [(c.type, c.status) for c in controller.view("down").conditions] == [
        ("Available", "True"), ("Progressing", "False"), ("Failed", "False"), ("Converged", "True")]
    assert condition(controller, "down", "Failed").last_transition_time >= failed.last_transition_time
