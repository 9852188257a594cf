"""The static manifests in deployments/kubernetes/ are valid objects and fit what the backend does."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from prefect.utilities.templating import apply_values, find_placeholders

from engine.control.leader import LEADER_LABEL
from engine.group.k8s.manifests import render
from engine.group.spec import InferenceGroup

K8S = Path(__file__).resolve().parents[4] / "deployments" / "kubernetes"
GROUPS = K8S.parent / "groups"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.mark.parametrize("name", ["router.yaml", "rbac.yaml", "controller.yaml"])
def test_core_manifests_validate(name, k8s_validate):
    for doc in docs(name):
        k8s_validate(doc)


@pytest.mark.parametrize("name, account", [("router.yaml", "tideflow-router"), ("controller.yaml", "tideflow-controller")])
def test_services_select_their_pods_and_accounts_exist(name, account):
    deployment, service = docs(name)[:2]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    static = {k: v for k, v in service["spec"]["selector"].items() if k != LEADER_LABEL}  # the leader sets that one
    assert static.items() <= pod_labels.items()
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account
    assert account in {d["metadata"]["name"] for d in docs("rbac.yaml") if d["kind"] == "ServiceAccount"}


def test_a_router_pod_disruption_leaves_a_router_serving():
    """Two router replicas, and a PodDisruptionBudget over exactly their pods that lets at most one go at a time."""
    deployment, _, budget = docs("router.yaml")
    assert budget["kind"] == "PodDisruptionBudget"
    assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert 1 <= budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_router_and_controller_commands_parse_and_meet():
    """Both run `tideflow ...` with flags that exist today, the routers watch the controller's Service, and
    every key either reads comes from the one Secret the README tells users to create."""
    from flows.cli import build_parser

    router, controller = docs("router.yaml")[0], docs("controller.yaml")[0]
    argv = {}
    for deployment in (router, controller):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["tideflow"]
        args = [a.replace("$(POD_IP)", "10.0.0.9").replace("$(POD_NAME)", "router-abc") for a in container["args"]]
        build_parser().parse_args(args)
        argv[container["name"]] = container["args"]
        secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert secrets == {"tideflow-keys"}
    controller_service = docs("controller.yaml")[1]
    url = argv["router"][argv["router"].index("--controller-url") + 1]
    assert url == f"http://{controller_service['metadata']['name']}:{controller_service['spec']['ports'][0]['port']}"
    assert argv["controller"][argv["controller"].index("--port") + 1] == str(controller_service["spec"]["ports"][0]["port"])
    router_service = docs("router.yaml")[1]
    assert argv["controller"][argv["controller"].index("--router-url") + 1] == \
        f"http://{router_service['metadata']['name']}:{router_service['spec']['ports'][0]['port']}"
    # two replicas, one leads (the Lease) and labels its pod, and only that label routes: a candidate is Ready
    # (a rolling update waits for its new pod to be Ready, while the old leader still holds the Lease)
    container = controller["spec"]["template"]["spec"]["containers"][0]
    assert controller["spec"]["replicas"] == 2 and container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert controller_service["spec"]["selector"][LEADER_LABEL] == "true"
    assert LEADER_LABEL not in controller["spec"]["selector"]["matchLabels"]  # both replicas are the Deployment's
    pod_name = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name and pod_name[0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_monitors_have_required_structure_and_match_targets():
    pod_monitor, service_monitor = docs("monitoring.yaml")
    for doc, kind, endpoints in ((pod_monitor, "PodMonitor", "podMetricsEndpoints"), (service_monitor, "ServiceMonitor", "endpoints")):
        assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", kind)
        assert doc["metadata"]["name"] and isinstance(doc["spec"]["selector"], dict)
        for endpoint in doc["spec"][endpoints]:
            assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    lws = render(InferenceGroup.from_yaml(GROUPS / "tiny-pd.yaml"), "ns", "img")[0]
    pod_labels = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "http" in [p["name"] for p in lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["ports"]]
    router_service = docs("router.yaml")[1]
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= router_service["metadata"]["labels"].items()


def test_work_pool_template_renders_a_valid_job(k8s_validate):
    template = json.loads((K8S / "prefect-work-pool.json").read_text())
    variables = template["variables"]["properties"]
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    assert used <= set(variables), f"placeholders without a variable: {used - set(variables)}"
    values = {k: v["default"] for k, v in variables.items() if "default" in v}
    values |= {"name": "release-abc", "command": "prefect flow-run execute 1234"}
    config = apply_values(template["job_configuration"], values)
    job = config["job_manifest"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    # What the Prefect Kubernetes worker does before submitting: env dict -> list, command -> argv.
    container["env"] = [{"name": k, "value": v} for k, v in container["env"].items()]
    container["args"] = shlex.split(container["args"])
    k8s_validate(job)
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "tideflow-flows"
    sa_names = {d["metadata"]["name"] for d in docs("rbac.yaml") if d["kind"] == "ServiceAccount"}
    assert "tideflow-flows" in sa_names
    assert config["namespace"] == job["metadata"]["namespace"] == "tideflow"
