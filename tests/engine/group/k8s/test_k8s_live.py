"""KubernetesBackend against a real API server with LWS installed; skipped unless one is configured.

Needs KUBECONFIG pointing at the cluster and TIDEFLOW_TEST_IMAGE naming an image whose
`tideflow serve` answers /ready and /health and that holds the model at
$TIDEFLOW_HOME/models/default (TIDEFLOW_HOME is /var/lib/tideflow in the pods). Runs in a throwaway namespace that it deletes.
"""

from __future__ import annotations

import os
import uuid

import pytest

from engine.group.backend import Phase
from engine.group.spec import InferenceGroup

IMAGE = os.environ.get("TIDEFLOW_TEST_IMAGE")
pytestmark = [
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="KUBECONFIG is not set: no API server to test against"),
    pytest.mark.skipif(not IMAGE, reason="TIDEFLOW_TEST_IMAGE is not set: no engine image for the pods"),
]


@pytest.fixture
def live_backend():
    from kubernetes import client, config

    from engine.group.k8s.backend import KubernetesBackend

    api = config.new_client_from_config()
    try:
        client.ApisApi(api).get_api_versions()
    except Exception as exc:  # noqa: BLE001 - any failure means there is no usable cluster
        pytest.skip(f"API server in KUBECONFIG not reachable: {exc}")
    groups = {g.name for g in client.ApisApi(api).get_api_versions().groups}
    if "leaderworkerset.x-k8s.io" not in groups:
        pytest.skip("LeaderWorkerSet is not installed in the cluster (see deployments/kubernetes/README.md)")
    core = client.CoreV1Api(api)
    namespace = f"tideflow-test-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": namespace}})
    try:
        yield KubernetesBackend(api, namespace=namespace, image=IMAGE), core, namespace
    finally:
        core.delete_namespace(namespace, propagation_policy="Foreground")


def test_lifecycle(live_backend):
    backend, core, namespace = live_backend
    group = InferenceGroup.model_validate({
        "name": "live", "version": "v1", "model": {"path": "${TIDEFLOW_HOME}/models/default"},
        "roles": [{"role": "prefill"}, {"role": "decode", "parallel": "DEP2"}],
    })
    handle = backend.start(group)
    try:
        assert backend.wait_ready(handle, timeout_s=300)
        assert [m.phase for m in backend.members(handle)] == [Phase.READY] * 3
        victim = core.list_namespaced_pod(namespace, label_selector="tideflow.dev/role=decode,leaderworkerset.sigs.k8s.io/worker-index=1").items[0]
        core.delete_namespaced_pod(victim.metadata.name, namespace, grace_period_seconds=0)
        assert backend.wait_ready(handle, timeout_s=300)
        decode = [m for m in backend.members(handle) if m.role == "decode"]
        assert all(m.restarts >= 1 for m in decode)
        backend.scale("live", "prefill", 2)
        assert backend.wait_ready(handle, timeout_s=300)
        assert len([m for m in backend.members(handle) if m.role == "prefill"]) == 2
    finally:
        backend.delete(handle)
    assert backend.members(handle) == []
