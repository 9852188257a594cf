"""The controller's Kubernetes runtime: desired state in a ConfigMap that a restarted controller reads back,
adoption that deletes what nobody wants, fault-drill kills through the API, and a Role that allows exactly
the requests all of this sends.

No API server can be had on these machines: the LWS/Pod traffic is the synthetic recordings (see
synthetic.py) and the ConfigMap API is a hand-made stateful stand-in (conftest.ReplayServer._configmap).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

import k8s_synthetic as synthetic  # loaded by conftest.py
from engine.control.kube_store import CONFIGMAP, KubeStore, StoreError, secret_env
from engine.control.leader import LeaseElector
from engine.control.k8s_runtime import KubernetesRuntime
from engine.control.runtime import ControllerConfig
from engine.control.store import DesiredGroup
from engine.group.backend import GroupHandle
from engine.group.k8s.backend import KubernetesBackend
from engine.runtime.process import tideflow_argv

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

NS, GROUP = synthetic.NS, synthetic.GROUP
HANDLE = GroupHandle(id=f"{NS}/demo", group="demo", version="v1", backend="kubernetes")
RBAC = Path(__file__).resolve().parents[4] / "deployments" / "kubernetes" / "rbac.yaml"


def api_for(server) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=server.url))


def backend_for(server, tmp_path) -> KubernetesBackend:
    return KubernetesBackend(api_for(server), namespace=NS, image=synthetic.IMAGE, discovery_cache=tmp_path / "d.json")


def test_desired_state_written_by_one_controller_is_read_back_by_the_next(replay):
    server = replay()
    first = KubeStore(api_for(server), NS)
    assert first.groups() == {} and server.configmaps[CONFIGMAP]["data"] == {}  # created on first start
    first.put_group(DesiredGroup(spec=GROUP, weight=0.25, standby=False))
    first.put_group(DesiredGroup(spec=GROUP.model_copy(update={"name": "demo-1"}), weight=0.0, standby=True))
    first.put_autoscaler("demo", '{"template": "x"}')
    first.put_canary('{"decision": "promoted"}')
    first.event("apply", "group demo v1")
    assert first.delete_group("demo-1") and not first.delete_group("demo-1")

    restarted = KubeStore(api_for(server), NS)  # a new controller pod
    assert restarted.groups() == {"demo": DesiredGroup(spec=GROUP, weight=0.25, standby=False)}
    assert restarted.autoscalers() == {"demo": '{"template": "x"}'}
    assert restarted.canary() == '{"decision": "promoted"}'
    assert [(e.kind, e.message) for e in restarted.events()] == [("apply", "group demo v1")]
    patches = [r for r in server.sent("PATCH") if "/configmaps/" in r["path"]]
    assert patches and all(set(p["body"]) == {"data"} for p in patches)  # merge patches of data only


def test_keys_come_from_the_environment_and_a_missing_one_names_the_secret(replay):
    store = KubeStore(api_for(replay()), NS, environ={secret_env("controller_admin"): "k-admin"})
    assert store.secret("controller_admin") == "k-admin"
    with pytest.raises(StoreError, match="TIDEFLOW_SECRET_ROUTES is not set.*Secret tideflow-keys \\(key routes\\)"):
        store.secret("routes")


def test_a_restarted_controller_deletes_running_groups_nobody_wants(replay, tmp_path):
    server = replay("discovery", "adopt")
    runtime = KubernetesRuntime(ControllerConfig(backend="kubernetes", model_dir=tmp_path, namespace=NS, port=9000,
                                                 image=synthetic.IMAGE), api=api_for(server),
                                discovery_cache=tmp_path / "discovery.json")
    runtime.adopt(manager=None)
    assert [d["path"].rsplit("/", 1)[-1] for d in server.sent("DELETE")] == [
        "demo-prefill", "demo-decode", "demo-prefill-leaders", "demo-decode-leaders", "demo-prefill", "demo-decode"]
    assert any(e.kind == "reap" and "demo" in e.message for e in runtime.store.events())
    assert server.unused() == []


def test_a_desired_group_is_left_running_for_the_reconcile_to_reapply(replay, tmp_path):
    server = replay("discovery", "adopt")
    KubeStore(api_for(server), NS).put_group(DesiredGroup(spec=GROUP, weight=1.0))
    runtime = KubernetesRuntime(ControllerConfig(backend="kubernetes", model_dir=tmp_path, namespace=NS, port=9000,
                                                 image=synthetic.IMAGE), api=api_for(server),
                                discovery_cache=tmp_path / "discovery.json")
    runtime.adopt(manager=None)
    assert server.sent("DELETE") == []


def test_a_fault_drill_kill_deletes_the_pod_at_once_and_sees_it_gone(replay, tmp_path):
    server = replay("discovery", "kill")
    backend = backend_for(server, tmp_path)
    members = backend.identities(HANDLE)
    assert [(m.role, m.instance, m.rank) for m in members] == [("decode", 0, 0), ("decode", 0, 1), ("prefill", 0, 0)]
    assert all(re.fullmatch(r"pod demo-\S+ [0-9a-f-]{36}", m.id) and m.pid is None for m in members)
    victim = members[1]
    assert backend.kill(HANDLE, victim, confirm_s=5) is True
    (sent,) = server.sent("DELETE")
    assert sent["path"].endswith("/pods/demo-decode-0-1")
    assert sent["body"]["gracePeriodSeconds"] == 0 and sent["body"]["preconditions"]["uid"] == victim.id.split()[-1]
    assert server.unused() == []


def test_the_controller_role_allows_exactly_the_requests_it_sends(replay, tmp_path):
    """Least privilege, checked against traffic: every request the backend, the store and the leader election
    send in these scenarios is allowed by the Role, and every verb the Role grants is used by one of them."""
    sent: list[dict] = []
    scenarios = [("apply", lambda b: b.start(GROUP)), ("ready", lambda b: b.wait_ready(HANDLE, 30)),
                 ("scale", lambda b: b.scale("demo", "prefill", 3)), ("stop", lambda b: b.stop(HANDLE, 0)),
                 ("delete", lambda b: b.delete(HANDLE)), ("kill", lambda b: b.kill(HANDLE, b.identities(HANDLE)[1], 5)),
                 ("adopt", lambda b: b.running_groups())]
    for i, (name, act) in enumerate(scenarios):
        server = replay("discovery", name)
        act(KubernetesBackend(api_for(server), namespace=NS, image=synthetic.IMAGE, discovery_cache=tmp_path / f"{i}.json"))
        sent += server.sent()
    server = replay()
    store = KubeStore(api_for(server), NS)
    store.put_group(DesiredGroup(spec=GROUP, weight=1.0))
    KubeStore(api_for(server), NS).groups()
    sent += server.sent()
    server = replay()  # leader election: campaign (create), renew (get, update), hand over (get, update), the label
    elector = LeaseElector(api_for(server), NS, "ctl-a", pod="tideflow-controller-abc")
    assert elector.campaign() and elector.try_acquire_or_renew()
    elector.release()
    sent += server.sent()

    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "Role")
    needed = {need for r in sent for need in _authorizations(r)}
    granted = {(g, res, verb, name) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for verb in rule["verbs"] for name in rule.get("resourceNames", [None])}

    def grant_of(g, res, verb, name):
        return (g, res, verb, None) if (g, res, verb, None) in granted else (g, res, verb, name)

    assert sorted({grant_of(*n) for n in needed} - granted, key=str) == [], "sent but not allowed"
    assert sorted(granted - {grant_of(*n) for n in needed}, key=str) == [], "granted but never used"


def _authorizations(request: dict) -> list[tuple[str, str, str, str | None]]:
    """What the API server authorizes for the request: (apiGroup, resource[/subresource], verb, name).
    Discovery needs nothing (every authenticated client may read it)."""
    parts = request["path"].strip("/").split("/")
    if parts[0] == "api":
        rest = parts[2:]
        group = ""
    elif parts[0] == "apis" and len(parts) > 3:
        rest = parts[3:]
        group = parts[1]
    else:
        return []
    if len(rest) < 3 or rest[0] != "namespaces":
        return []
    resource, name = rest[2], (rest[3] if len(rest) > 3 else None)
    if len(rest) > 4:
        resource += "/" + rest[4]
    method = request["method"]
    if method == "GET":
        verb = "watch" if request["query"].get("watch") == "true" else ("get" if name else "list")
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]
    needs = [(group, resource, verb, name)]
    if "apply-patch" in (request["content_type"] or ""):
        needs.append((group, resource, "create", None))  # server-side apply creates what does not exist yet
    return needs


def test_the_backend_is_chosen_by_config_and_a_missing_cluster_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_BACKEND", "kubernetes")
    monkeypatch.setenv("TIDEFLOW_NAMESPACE", "fleet")
    config = ControllerConfig(model_dir=tmp_path)
    assert (config.backend, config.namespace) == ("kubernetes", "fleet")
    env = {**os.environ, "TIDEFLOW_HOME": str(tmp_path / "home"), "KUBECONFIG": str(tmp_path / "none"),
           "KUBERNETES_SERVICE_HOST": ""}
    for extra, expected in (([], "--port is needed on kubernetes"), (["--port", "9000"], "no Kubernetes API to talk to")):
        done = subprocess.run(tideflow_argv("controller", "--model-dir", str(tmp_path), *extra), env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
