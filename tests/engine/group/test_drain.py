"""Draining a group that has just fallen out of routing (its supervisor deregistered it a moment before):
the router refuses its weight, and park or stop must go on instead of failing the caller."""

from __future__ import annotations

from engine.control.routes import RouteTable
from engine.group.manager import GroupState, ManagedGroup, SupervisionPolicy
from engine.group.spec import InferenceGroup


def test_park_of_a_group_that_just_left_routing_goes_on(tmp_path):
    spec = InferenceGroup.model_validate({"name": "fell", "version": "v1", "model": {"path": "unused"},
                                          "roles": [{"role": "colocated"}]})
    routes = RouteTable()  # "fell" is not registered: the router has dropped it
    group = ManagedGroup(spec, backend=None, router=routes, policy=SupervisionPolicy())
    group._event(GroupState.READY, "serving")  # what the control call saw before the fall
    group.park(drain_s=5.0)  # before: RouterAdminError "not routed now" out of park, to the API as a 500
    assert group.status.state == GroupState.STANDBY and group.standby
