"""KubernetesBackend driving the real `kubernetes` client against recorded API server responses."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from engine.group.backend import BackendError, GroupHandle, Phase
from engine.group.k8s.backend import KubernetesBackend
from engine.group.k8s.manifests import render
import k8s_synthetic as synthetic  # loaded by conftest.py

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

NS, GROUP = synthetic.NS, synthetic.GROUP  # the namespace and group of the synthetic recordings
HANDLE = GroupHandle(id=f"{NS}/demo", group="demo", version="v1", backend="kubernetes")


def backend_for(server, tmp_path) -> KubernetesBackend:
    api = client.ApiClient(client.Configuration(host=server.url))
    return KubernetesBackend(api, namespace=NS, image="tideflow:test", discovery_cache=tmp_path / "discovery.json")


def test_start_applies_every_object_server_side(replay, tmp_path):
    server = replay("discovery", "apply")
    handle = backend_for(server, tmp_path).start(GROUP)
    assert handle == HANDLE
    patches = server.sent("PATCH")
    docs = render(GROUP, NS, "tideflow:test")
    assert [p["path"] for p in patches] == [
        f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/demo-prefill",
        f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/demo-decode",
        f"/api/v1/namespaces/{NS}/services/demo-prefill-leaders",
        f"/api/v1/namespaces/{NS}/services/demo-decode-leaders",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/demo-prefill",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/demo-decode",
    ]
    for sent, doc in zip(patches, docs):
        assert sent["content_type"] == "application/apply-patch+yaml"
        assert sent["query"] == {"fieldManager": "tideflow", "force": "true"}
        assert sent["body"] == doc
    discovered = {r["path"] for r in server.sent("GET")}
    assert {"/apis", "/api/v1", "/apis/leaderworkerset.x-k8s.io/v1", "/apis/policy/v1"} <= discovered
    assert server.unused() == []


def test_wait_ready_watches_until_every_member_ready(replay, tmp_path):
    server = replay("discovery", "ready")
    backend = backend_for(server, tmp_path)
    assert backend.wait_ready(HANDLE, timeout_s=30) is True
    watch = [r for r in server.sent("GET") if r["query"].get("watch") == "true"]
    assert watch[0]["query"]["resourceVersion"] == "4201"
    assert watch[0]["query"]["labelSelector"] == "tideflow.dev/group=demo,tideflow.dev/warm-pool=false"
    members = backend.members(HANDLE)
    assert [(m.role, m.instance, m.rank, m.phase) for m in members] == [
        ("decode", 0, 0, Phase.READY), ("decode", 0, 1, Phase.READY), ("prefill", 0, 0, Phase.READY)]
    assert [m.endpoint for m in members] == ["http://10.244.2.21:8100", "http://10.244.3.31:8100", "http://10.244.1.11:8100"]
    assert all(m.restarts == 0 for m in members)
    assert server.unused() == []


def test_member_failure_then_group_recreate_is_observed(replay, tmp_path):
    server = replay("discovery", "ready", "failure")
    backend = backend_for(server, tmp_path)
    assert backend.wait_ready(HANDLE, timeout_s=30)
    backend.members(HANDLE)
    crashed = {(m.role, m.rank): m for m in backend.members(HANDLE)}
    assert crashed["decode", 1].phase is Phase.RUNNING and crashed["decode", 1].restarts == 1
    assert "restarted after Error (exit 1)" in crashed["decode", 1].message
    assert backend.wait_ready(HANDLE, timeout_s=30)  # LWS tears the decode instance down and rebuilds it
    rebuilt = {(m.role, m.rank): m for m in backend.members(HANDLE)}
    assert all(m.phase is Phase.READY for m in rebuilt.values())
    assert rebuilt["decode", 0].restarts == 1 and rebuilt["decode", 1].restarts == 1  # the whole instance, once
    assert rebuilt["prefill", 0].restarts == 0
    assert server.unused() == []


def test_wait_ready_gives_up_at_the_timeout(replay, tmp_path):
    server = replay("discovery", "never-ready")
    assert backend_for(server, tmp_path).wait_ready(HANDLE, timeout_s=1) is False
    assert any(r["query"].get("timeoutSeconds") == "1" for r in server.sent("GET"))


def test_scale_patches_the_lws_scale_subresource(replay, tmp_path):
    server = replay("discovery", "scale")
    backend_for(server, tmp_path).scale("demo", "prefill", 3)
    (sent,) = server.sent("PATCH")
    assert sent["path"] == f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/demo-prefill/scale"
    assert sent["content_type"] == "application/merge-patch+json"
    assert sent["body"] == {"spec": {"replicas": 3}}
    with pytest.raises(BackendError, match="instances must be >= 0"):
        backend_for(server, tmp_path).scale("demo", "prefill", -1)


def test_delete_is_foreground_and_waits_for_pods_gone(replay, tmp_path):
    server = replay("discovery", "delete")
    backend_for(server, tmp_path).delete(HANDLE)
    deletes = server.sent("DELETE")
    assert [d["path"].rsplit("/", 2)[-2:] for d in deletes] == [
        ["leaderworkersets", "demo-prefill"], ["leaderworkersets", "demo-decode"],
        ["services", "demo-prefill-leaders"], ["services", "demo-decode-leaders"],
        ["poddisruptionbudgets", "demo-prefill"], ["poddisruptionbudgets", "demo-decode"]]
    assert all(d["query"] == {"propagationPolicy": "Foreground"} for d in deletes)
    assert server.sent("GET")[-1]["query"]["watch"] == "true"
    assert server.unused() == []


def test_missing_lws_crd_says_how_to_install(replay, tmp_path):
    server = replay("discovery-without-lws")
    with pytest.raises(BackendError, match="LeaderWorkerSet.*install LWS"):
        backend_for(server, tmp_path).start(GROUP)
    assert server.sent("PATCH") == []


def test_unknown_request_surfaces_as_backend_error(replay, tmp_path):
    server = replay("discovery")
    with pytest.raises(BackendError, match="HTTP 404"):
        backend_for(server, tmp_path).scale("demo", "decode", 2)


def test_stop_unroutes_then_scales_to_zero_and_waits(replay, tmp_path):
    server = replay("discovery", "stop")
    backend_for(server, tmp_path).stop(HANDLE, drain_s=0)
    sent = [(r["method"], r["path"].rsplit("/", 1)[-1]) for r in server.sent() if r["method"] != "GET"]
    assert sent == [("DELETE", "demo-prefill-leaders"), ("DELETE", "demo-decode-leaders"), ("PATCH", "scale"), ("PATCH", "scale")]
    assert [r["body"] for r in server.sent("PATCH")] == [{"spec": {"replicas": 0}}] * 2
    assert server.unused() == []


def test_recordings_are_synthetic_and_carry_todays_manifests():
    """A change to the manifests that the recordings do not follow fails here, with the command that fixes it."""
    for path in synthetic.RECORDINGS.glob("*.json"):
        assert json.loads(path.read_text())["provenance"].startswith("synthetic:"), path.name
    assert synthetic.stale() == [], "run python tests/engine/group/k8s/synthetic.py"


def test_a_request_body_other_than_the_recorded_one_is_not_answered(replay, tmp_path):
    server = replay("discovery", "apply")
    other_image = KubernetesBackend(client.ApiClient(client.Configuration(host=server.url)), namespace=NS,
                                    image="tideflow:other", discovery_cache=tmp_path / "discovery.json")
    with pytest.raises(BackendError, match="HTTP 404"):
        other_image.start(GROUP)


def test_a_pods_exit_status_is_read_from_its_engine_container():
    """The group manager names a member failure by it (a weights refusal exits 3): the current run's
    termination when there is one, else the last run's (a container restarted in place)."""
    from engine.group.k8s.backend import _exit_code

    def pod(state: dict, last: dict | None = None) -> dict:
        return {"status": {"containerStatuses": [{"name": "engine", "state": state, "lastState": last or {}}]}}

    assert _exit_code(pod({"terminated": {"exitCode": 3, "reason": "Error"}})) == 3
    assert _exit_code(pod({"running": {}}, {"terminated": {"exitCode": 137, "reason": "OOMKilled"}})) == 137
    assert _exit_code(pod({"running": {}})) is None
    assert _exit_code({"status": {}}) is None
