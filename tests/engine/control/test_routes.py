"""The route set the controller publishes: long-poll semantics and drain accounting across replicas."""

from __future__ import annotations

import threading
import time

import pytest

from engine.control.routes import NotPublished, RouteTable
from engine.router.admin import RouterAdminError
from engine.router.registry import Endpoint, GroupRegistration, Registry
from engine.router.sync import GroupLoad, RouterReport

EP = [Endpoint(url="http://127.0.0.1:20001", role="colocated")]


def report(replica: str, revision: int, inflight: int) -> RouterReport:
    return RouterReport(replica=replica, revision=revision, groups={"a": GroupLoad(inflight=inflight, routable=True)})


def test_a_new_watcher_gets_the_set_at_once_and_a_waiting_one_on_the_next_change():
    table = RouteTable()
    table.publish()
    table.register("a", "v1", EP, 1.0)
    first = table.watch(after=0, wait_s=5)
    assert first.revision == 1 and [g.name for g in first.groups] == ["a"]
    got = []
    waiter = threading.Thread(target=lambda: got.append(table.watch(after=first.revision, wait_s=10)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # nothing changed yet: the watch holds
    table.set_weights({"a": 0.25})
    waiter.join(timeout=5)
    assert got and got[0].revision == 2 and got[0].groups[0].weight == 0.25
    assert table.watch(after=2, wait_s=0.1).revision == 2  # no change within wait_s: the same set back


def test_inflight_waits_for_every_live_replica_to_serve_the_latest_change():
    table = RouteTable()
    table.register("a", "v1", EP)
    table.report(report("r1", 1, 0))
    table.report(report("r2", 1, 3))
    assert table.inflight("a") == 3
    table.set_weights({"a": 0.0})  # revision 2: a report from revision 1 says nothing about the drain
    table.report(report("r2", 2, 0))
    assert table.inflight("a") == 1  # r1 still serves revision 1: not known to be drained
    table.report(report("r1", 2, 0))
    assert table.inflight("a") == 0
    assert {r["replica"] for r in table.replicas()} == {"r1", "r2"}


def test_a_change_is_applied_once_every_live_replica_serves_its_revision():
    table = RouteTable()
    table.register("a", "v1", EP)
    assert table.applied(table.revision) == (False, 0)  # no replica: in effect nowhere
    table.report(report("r1", 1, 0))
    table.report(report("r2", 1, 0))
    table.set_weights({"a": 0.5})
    assert table.applied(2) == (False, 2)
    table.report(report("r1", 2, 0))
    assert table.applied(2) == (False, 2)  # r2 still routes by the old weight
    table.report(report("r2", 3, 0))
    assert table.applied(2) == (True, 2)


def test_a_replica_seen_dead_leaves_the_reads_at_once():
    """Its report would live REPLICA_TTL_S more, and a reader of replica URLs (the canary's samples, the metric
    scrape) would meet a refused connection there."""
    table = RouteTable()
    table.register("a", "v1", EP)
    for replica in ("host/101/aa", "host/1011/bb", "host/202/cc"):
        table.report(report(replica, 1, 0))
    table.forget_replicas([101])
    assert sorted(r["replica"] for r in table.replicas()) == ["host/1011/bb", "host/202/cc"]  # pid 1011 is not 101
    table.forget_replicas([])
    assert len(table.replicas()) == 2


def test_a_mixed_change_naming_an_unrouted_group_changes_nothing():
    table = RouteTable()
    table.register("a", "v1", EP, 1.0)
    with pytest.raises(RouterAdminError, match="ghost"):
        table.set_weights({"a": 0.0, "ghost": 1.0})
    assert [g["weight"] for g in table.groups()] == [1.0] and table.revision == 1


def test_weights_for_a_group_that_is_not_routed_are_refused():
    table = RouteTable()
    with pytest.raises(RouterAdminError, match="not routed now"):
        table.set_weights({"ghost": 1.0})


def test_close_ends_every_watch():
    table = RouteTable()
    table.publish()
    ended = []

    def wait() -> None:
        try:
            ended.append(table.watch(after=0, wait_s=30).revision)  # the set as it stands: still true
        except NotPublished as exc:
            ended.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    table.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and ended == [0]
    with pytest.raises(NotPublished, match="stopping"):  # a watch after close: the router keeps its set
        table.watch(after=0, wait_s=30)


def test_registry_replace_keeps_health_of_unchanged_groups_and_drops_the_rest():
    registry = Registry()
    registry.register(GroupRegistration(name="a", version="v1", endpoints=EP))
    registry.register(GroupRegistration(name="b", version="v1", endpoints=EP))
    registry.get("a").endpoints[0].healthy = False  # ejected by the health monitor
    registry.replace([GroupRegistration(name="a", version="v1", endpoints=EP, weight=0.5)])
    assert [g.reg.name for g in registry.groups()] == ["a"]
    kept = registry.get("a")
    assert kept.reg.weight == 0.5 and kept.endpoints[0].healthy is False
    registry.replace([GroupRegistration(name="a", version="v2", endpoints=EP)])
    assert registry.get("a").endpoints[0].healthy is True  # a new version is a new group


def test_a_restarted_controller_answers_no_route_set_until_it_has_adopted():
    """Its table starts empty: answering with it would empty every router that kept serving meanwhile."""
    table = RouteTable()
    with pytest.raises(NotPublished):
        table.watch(after=57, wait_s=0.1)
    table.register("a", "v1", EP)
    table.publish()
    assert [g.name for g in table.watch(after=57, wait_s=0.1).groups] == ["a"]
