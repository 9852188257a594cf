"""Leader election between two controller replicas through a coordination.k8s.io Lease (engine/control/leader.py).

No API server can be had on these machines: the Lease API is a hand-made stateful stand-in with the API
server's optimistic concurrency (conftest.ReplayServer._lease), and the candidates' clocks are the tests' own,
so expiry is decided without waiting out real Lease durations."""

from __future__ import annotations

import threading

import pytest

from kubernetes import client

import k8s_synthetic as synthetic  # loaded by conftest.py
from engine.control.leader import LEADER_LABEL, LeaseConfig, LeaseElector

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

NS = synthetic.NS
FAST = LeaseConfig(duration_s=3, renew_deadline_s=0.4, retry_s=0.05)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def elector(server, identity: str, clock=None, config: LeaseConfig = LeaseConfig()) -> LeaseElector:
    return LeaseElector(client.ApiClient(client.Configuration(host=server.url)), NS, identity, config,
                        **({"clock": clock} if clock else {}), pod=f"pod-{identity}")


def test_one_candidate_leads_and_the_other_takes_over_only_once_the_lease_lapsed(replay):
    server = replay()
    a_clock, b_clock = Clock(), Clock()
    a, b = elector(server, "ctl-a", a_clock), elector(server, "ctl-b", b_clock)
    assert a.try_acquire_or_renew()  # created it
    assert not b.try_acquire_or_renew() and b.holder == "ctl-a"
    lease = server.leases["tideflow-controller"]["spec"]
    assert lease["holderIdentity"] == "ctl-a" and lease["leaseTransitions"] == 0
    b_clock.t += 14  # within the 15 s Lease as b saw it: still a's
    assert not b.try_acquire_or_renew()
    assert a.try_acquire_or_renew()  # a renews: b sees a change, and its wait starts again
    b_clock.t += 14
    assert not b.try_acquire_or_renew()
    b_clock.t += 16  # a stopped renewing 16 s ago as b's own clock counts (whatever a's clock says)
    assert b.try_acquire_or_renew() and b.holder == "ctl-b"
    lease = server.leases["tideflow-controller"]["spec"]
    assert lease["holderIdentity"] == "ctl-b" and lease["leaseTransitions"] == 1
    assert not a.try_acquire_or_renew() and a.holder == "ctl-b"  # a finds it taken: not its own any more


def test_two_candidates_racing_for_a_lapsed_lease_cannot_both_win(replay):
    """Both read the same expired Lease; the API server takes the first replace and refuses the second (409)."""
    server = replay()
    old = elector(server, "ctl-old")
    assert old.try_acquire_or_renew()
    clocks = [Clock(), Clock()]
    racers = [elector(server, f"ctl-{i}", clocks[i]) for i in range(2)]
    for r, clock in zip(racers, clocks):
        assert not r.try_acquire_or_renew()
        clock.t += 20
    stale = client.CoordinationV1Api(racers[1].api.api_client).read_namespaced_lease("tideflow-controller", NS)
    assert racers[0].try_acquire_or_renew()
    # racers[1] writes what it read before racers[0] won: refused, it does not lead
    real_read = racers[1].api.read_namespaced_lease
    racers[1].api.read_namespaced_lease = lambda *a, **k: stale
    try:
        assert not racers[1].try_acquire_or_renew()
    finally:
        racers[1].api.read_namespaced_lease = real_read
    assert server.leases["tideflow-controller"]["spec"]["holderIdentity"] == "ctl-0"


def test_a_clean_stop_hands_the_lease_over_at_once_and_the_service_follows_the_label(replay):
    """The controller Service selects LEADER_LABEL=true: the leader's pod carries it, a candidate's does not, and
    a leader that stops takes it off before it hands the Lease over."""
    server = replay()
    a, b = elector(server, "ctl-a"), elector(server, "ctl-b")
    server.pod_labels["pod-ctl-b"] = {LEADER_LABEL: "true"}  # b led from this pod before it restarted
    assert a.campaign()
    assert not b.campaign(stop=_stopped_after(0.3))  # a holds it: b keeps campaigning until told to stop
    assert server.pod_labels == {"pod-ctl-a": {LEADER_LABEL: "true"}, "pod-ctl-b": {LEADER_LABEL: "false"}}
    a.release()
    assert server.pod_labels["pod-ctl-a"] == {LEADER_LABEL: "false"}
    assert server.leases["tideflow-controller"]["spec"].get("holderIdentity") is None
    assert b.campaign()  # no waiting out the 15 s
    assert server.pod_labels["pod-ctl-b"] == {LEADER_LABEL: "true"}


def _stopped_after(s: float) -> threading.Event:
    stop = threading.Event()
    threading.Timer(s, stop.set).start()
    return stop


def kept(server) -> tuple[LeaseElector, threading.Event, list[str]]:
    """A leader renewing on its thread: (it, set once it gave up, why)."""
    leader = elector(server, "ctl-a", config=FAST)
    assert leader.campaign()
    lost = threading.Event()
    reasons: list[str] = []
    leader.keep(on_lost=lambda why: (reasons.append(why), lost.set()))
    return leader, lost, reasons


def test_a_leader_that_cannot_renew_gives_up_before_its_lease_lapses(replay):
    server = replay()
    leader, lost, reasons = kept(server)
    assert not lost.wait(0.5)  # renewing well
    server.refuse_leases = True  # the API server is gone for this replica
    assert lost.wait(10), "the leader kept acting without its Lease"
    assert "renewal failed" in reasons[0]
    leader.release()


def test_a_leader_that_sees_another_holder_gives_up_at_once(replay):
    server = replay()
    leader, lost, reasons = kept(server)
    server.leases["tideflow-controller"]["spec"]["holderIdentity"] = "ctl-b"  # taken (a partition healed late)
    server.leases["tideflow-controller"]["metadata"]["resourceVersion"] = "999"
    assert lost.wait(10) and "ctl-b holds the Lease" in reasons[0]
    leader.release()
    assert server.leases["tideflow-controller"]["spec"]["holderIdentity"] == "ctl-b"  # release leaves others' alone


def test_a_campaigning_replica_is_alive_but_not_ready_and_names_the_leader():
    from fastapi.testclient import TestClient

    from engine.control.api import create_standby_app

    with TestClient(create_standby_app(lambda: "ctl-a")) as http:
        assert http.get("/health").status_code == 200
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"ready": False, "leader": "ctl-a"}
