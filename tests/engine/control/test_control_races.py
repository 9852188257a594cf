"""The controller's threads against each other (issue #38's list, each made to happen on cue): a group whose
observation breaks never reads Ready, a group is stopped once however many ask, a deleted group stays
deleted whatever falls meanwhile, replacing an autoscaler never waits on the lock its old tick waits for,
and a Failed group that is still desired is tried again."""

from __future__ import annotations

import threading
import time

import pytest

from engine.control.controller import _LockedPool
from engine.control.models import ApplyGroup, AutoscalerBody, KillMember
from engine.group.manager import GroupState, ManagedGroup
from engine.scaling.policy import Bounds, ScalingPolicy
from tests.engine.control.fake_fleet import group_spec, table_controller


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    controller, backend = table_controller(tmp_path, tmp_path / "model")
    try:
        yield controller, backend
    finally:
        controller.close(stop_fleet=True, drain_s=0.1)
        controller.store.close()


def wait_state(controller, name: str, states: set[GroupState], timeout_s: float = 20) -> GroupState:
    return controller.manager.groups[name].wait_for(states, timeout_s)


def until(condition, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def routed(controller) -> list[str]:
    return [g["name"] for g in controller.routes.groups()]


def serving(controller, name: str, standby: bool = False) -> None:
    controller.apply(ApplyGroup(spec=group_spec(name), weight=1.0, standby=standby))
    want = GroupState.STANDBY if standby else GroupState.READY
    assert wait_state(controller, name, {want, GroupState.FAILED}) == want


def test_a_group_whose_members_cannot_be_observed_leaves_routing_and_never_reads_ready(fleet):
    """On Kubernetes an API error from members() escaped the supervisor after the group had been deregistered
    and its members deleted, and the group read Ready for ever."""
    controller, backend = fleet
    serving(controller, "blind")
    assert routed(controller) == ["blind"]
    backend.blind.add("blind")
    assert wait_state(controller, "blind", {GroupState.STARTING, GroupState.FAILED}) != GroupState.READY
    assert routed(controller) == []
    backend.blind.discard("blind")  # the API answers again: the group is rebuilt and serves
    assert wait_state(controller, "blind", {GroupState.READY}) == GroupState.READY


def test_a_group_deleted_while_reconcile_runs_is_stopped_once(fleet, monkeypatch):
    """delete() drained outside the lock without telling reconcile, which then stopped the group a second time."""
    controller, _ = fleet
    serving(controller, "once")
    calls, entered, release = [], threading.Event(), threading.Event()
    original = ManagedGroup.drain_and_stop

    def slow_drain(self, drain_s=30.0):
        calls.append(self.spec.name)
        entered.set()
        release.wait(20)  # the first stop is still draining when reconcile looks
        original(self, drain_s)

    monkeypatch.setattr(ManagedGroup, "drain_and_stop", slow_drain)
    deleting = threading.Thread(target=controller.delete, args=("once", 0.1))
    deleting.start()
    assert entered.wait(20)
    controller.reconcile()
    release.set()
    deleting.join(30)
    assert not deleting.is_alive()
    controller.reconcile()
    assert calls == ["once"]
    assert "once" not in controller.manager.groups and "once" not in controller.store.groups()
    serving(controller, "once")  # applied again at once after the delete returned: a new group, not a 409


def test_a_deleted_group_that_falls_meanwhile_stays_deleted(fleet):
    """A fall while the group is being deleted replaced it with a standby and wrote the fallen group back
    into desired state (_replace -> _sync_desired), so the next pass started it again."""
    controller, backend = fleet
    serving(controller, "gone")
    serving(controller, "spare", standby=True)
    controller.store.delete_group("gone")  # what delete() does first; the stop has not landed yet
    backend.fall("gone")
    assert wait_state(controller, "spare", {GroupState.READY}) == GroupState.READY  # the spare took its traffic
    assert until(lambda: any(e.kind == "replace" for e in controller.store.events()))  # written after its write-backs
    assert "gone" not in controller.store.groups()
    controller.reconcile()
    assert "gone" not in controller.store.groups()
    assert wait_state(controller, "gone", {GroupState.STOPPED, GroupState.FAILED}) in (GroupState.STOPPED,
                                                                                       GroupState.FAILED)


def test_replacing_an_autoscaler_never_waits_for_its_old_tick(fleet, monkeypatch):
    """start_autoscaler joined the old autoscaler while holding the controller's lock, and the old one's tick
    waited for that lock in scale_to: every API call froze for the join's 60 s. The old tick is caught between
    deciding and scaling (a slow observation) when the new autoscaler is asked for."""
    controller, _ = fleet
    ticking = threading.Event()
    capacity = _LockedPool.capacity

    def slow_capacity(self):
        ticking.set()
        time.sleep(0.3)  # still deciding when start_autoscaler takes the lock
        return capacity(self)

    monkeypatch.setattr(_LockedPool, "capacity", slow_capacity)
    body = AutoscalerBody(template=group_spec("tide"),
                          policy=ScalingPolicy(bounds=Bounds(min_groups=0, max_groups=1), warm_pool=0, tick_s=0.05))
    controller.start_autoscaler(body)
    done = threading.Event()
    ticking.clear()
    assert ticking.wait(20)
    threading.Thread(target=lambda: (controller.start_autoscaler(body), done.set()), daemon=True).start()
    assert done.wait(10), "start_autoscaler waited on the old autoscaler's tick"
    assert controller.autoscaler_view("tide").name == "tide"
    assert len(controller.autoscalers) == 1


def test_a_failed_group_that_is_still_desired_is_tried_again(fleet):
    """reconcile restarted only Stopped groups: one that gave up stayed Failed for ever, though still desired."""
    controller, backend = fleet
    backend.refuse["stubborn"] = 4  # one start and three rebuilds refused: the group ends Failed
    controller.apply(ApplyGroup(spec=group_spec("stubborn"), weight=1.0))
    assert wait_state(controller, "stubborn", {GroupState.FAILED}) == GroupState.FAILED
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and controller.manager.groups["stubborn"].status.state != GroupState.READY:
        controller.reconcile()
        time.sleep(0.05)
    assert controller.manager.groups["stubborn"].status.state == GroupState.READY
    assert any("retry" in e.message for e in controller.store.events() if e.kind == "retry")


def test_fault_drills_spend_no_crash_budget_and_are_counted_apart(fleet):
    """Three drill kills inside reset_after_s used to spend a group's restart budget, so the next drill (or the
    next real crash) ended the production group Failed."""
    controller, backend = fleet
    serving(controller, "drilled")
    status = controller.manager.groups["drilled"].status
    for i in range(controller.config.policy.max_restarts + 1):
        controller.kill_member("drilled", KillMember(target="colocated"))
        assert until(lambda: status.drill_rebuilds == i + 1 or status.state == GroupState.FAILED)
        assert wait_state(controller, "drilled", {GroupState.READY, GroupState.FAILED}) == GroupState.READY
    view = controller.view("drilled")
    assert (view.restarts, view.drill_rebuilds) == (0, controller.config.policy.max_restarts + 1)
    assert status.rebuilds == 0 and status.member_failures["drill"] == controller.config.policy.max_restarts + 1
    backend.fall("drilled")  # a real crash still counts
    assert until(lambda: status.rebuilds == 1)
    assert wait_state(controller, "drilled", {GroupState.READY, GroupState.FAILED}) == GroupState.READY
    assert controller.view("drilled").restarts == 1 and controller.manager.groups["drilled"].status.rebuilds == 1
