"""Kubernetes manifests for an InferenceGroup: per role a LeaderWorkerSet, a leader Service and a PDB.

One LWS replica is one role instance (`spec.replicas` = instances, `size` = members per instance);
`RecreateGroupOnPodRestart` makes LWS rebuild an instance whole when any member restarts, which is
the group atomicity of DESIGN.md at instance granularity.

Routing and the warm pool are labels, not objects: the router discovers leaders through the
headless Service `<group>-<role>-leaders`, which selects `tideflow.dev/routable: "true"` pods only.
The warm pool is one extra LWS per role, `<group>-<role>-standby`, with `warm_pool x instances`
replicas whose pods are labelled `routable: "false"` and `warm-pool: "true"` and run `--standby`
(loaded, warmed, KV freed). Promoting a standby instance is a label flip on its pods, done by whoever
owns registration; nothing here needs to be re-applied for it. A group started with `standby=True`
renders its own LWSes non-routable and has no pool of its own.
"""

from __future__ import annotations

from typing import Any

import yaml

from engine.group.argv import serve_argv
from engine.group.spec import InferenceGroup, RoleSpec

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
# Labels the LWS controller puts on every pod it creates.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

GROUP_LABEL = "tideflow.dev/group"
VERSION_LABEL = "tideflow.dev/version"
ROLE_LABEL = "tideflow.dev/role"
ROUTABLE_LABEL = "tideflow.dev/routable"
POOL_LABEL = "tideflow.dev/warm-pool"
NAME_LABEL = "app.kubernetes.io/name"

ENGINE_PORT = 8100
MEMBER_KEY_ENV = "TIDEFLOW_MEMBER_KEY"  # read by TIDEFLOW_API_KEYS's $(...) reference, which Kubernetes expands
KEYS_SECRET = "tideflow-keys"  # every key of the fleet; deployments/kubernetes/ maps them to env vars
NODE_CACHE = "/var/lib/tideflow"  # hostPath: the node's weights cache, TIDEFLOW_HOME inside the pod
STARTUP_BUDGET_S = 900  # weights load + warmup allowed before liveness applies


def lws_name(group: InferenceGroup, role: str, pool: bool = False) -> str:
    return f"{group.name}-{role}-standby" if pool else f"{group.name}-{role}"


def leader_service_name(group: InferenceGroup, role: str) -> str:
    # Not `<group>-<role>`: the LWS controller owns a headless Service of its own LWS's name.
    return f"{group.name}-{role}-leaders"


def labels(group: InferenceGroup, role: str, routable: bool, pool: bool) -> dict[str, str]:
    return group.labels | {
        NAME_LABEL: "tideflow",
        GROUP_LABEL: group.name,
        VERSION_LABEL: group.version,
        ROLE_LABEL: role,
        ROUTABLE_LABEL: "true" if routable else "false",
        POOL_LABEL: "true" if pool else "false",
    }


def role_selector(group: InferenceGroup, role: str) -> dict[str, str]:
    return {NAME_LABEL: "tideflow", GROUP_LABEL: group.name, ROLE_LABEL: role}


DIST_PORT = 29500  # torch.distributed rendezvous on each instance's leader


def engine_port(spec: RoleSpec) -> int:
    return spec.port_base or ENGINE_PORT


def _args(group: InferenceGroup, spec: RoleSpec, standby: bool) -> list[str]:
    """The pod's command line: its IP and, for DEP, the LWS worker index and leader address filled in by the kubelet."""
    model = group.model.uri or group.model.expanded_path({"TIDEFLOW_HOME": NODE_CACHE})
    # plain HTTP said on purpose: the fleet CA is not yet kept in a Secret here (a mesh encrypts pod-to-pod traffic)
    return serve_argv(group, spec, model=model, host="$(POD_IP)", port=engine_port(spec), served_name="default",
                      rank="$(LWS_WORKER_INDEX)", dist_addr=f"$(LWS_LEADER_ADDRESS):{DIST_PORT}",
                      standby=standby) + ["--plain-http"]


def _env() -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    return [
        {"name": "POD_IP", "valueFrom": field("status.podIP")},
        {"name": "TIDEFLOW_INSTANCE", "valueFrom": field(f"metadata.labels['{LWS_GROUP_INDEX_LABEL}']")},
        {"name": "TIDEFLOW_HOME", "value": NODE_CACHE},
        # The members' API key: only the router and the controller hold it (deployments/kubernetes/README.md).
        # It forwards (engine.api.auth.ApiKey): the router names the client each request is for.
        {"name": MEMBER_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": KEYS_SECRET, "key": "member"}}},
        {"name": "TIDEFLOW_API_KEYS", "value": f"$({MEMBER_KEY_ENV}) forwards"},
    ]


def _resources(spec: RoleSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    limits: dict[str, Any] = {"memory": spec.resources.memory}
    if spec.resources.gpus:
        # Extended resources must be whole and requests == limits; setting limits implies requests.
        limits["nvidia.com/gpu"] = spec.resources.gpus
    return {"requests": requests, "limits": limits}


def pod_template(group: InferenceGroup, spec: RoleSpec, image: str, routable: bool, pool: bool) -> dict[str, Any]:
    """The PodTemplateSpec of every member (leader and workers alike) of one role LWS."""
    port = engine_port(spec)
    probe = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 2, "failureThreshold": 3}
    container = {
        "name": spec.role,
        "image": image,
        "command": ["tideflow"],
        "args": _args(group, spec, standby=not routable),
        "env": _env(),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": probe,
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                         "failureThreshold": STARTUP_BUDGET_S // 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3},
        "resources": _resources(spec),
        "volumeMounts": [{"name": "node-cache", "mountPath": NODE_CACHE}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {
        "metadata": {"labels": labels(group, spec.role, routable, pool)},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 60,
            "containers": [container],
            "topologySpreadConstraints": [{
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": role_selector(group, spec.role)},
            }],
            "volumes": [
                {"name": "node-cache", "hostPath": {"path": NODE_CACHE, "type": "DirectoryOrCreate"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


def leader_worker_set(group: InferenceGroup, spec: RoleSpec, namespace: str, image: str,
                      routable: bool, pool: bool) -> dict[str, Any]:
    replicas = group.warm_pool * spec.instances if pool else spec.instances
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": lws_name(group, spec.role, pool), "namespace": namespace,
                     "labels": labels(group, spec.role, routable, pool)},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderReady",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
            "leaderWorkerTemplate": {
                "size": spec.members_per_instance,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod_template(group, spec, image, routable, pool),
            },
        },
    }


def leader_service(group: InferenceGroup, spec: RoleSpec, namespace: str) -> dict[str, Any]:
    """Headless: the router resolves every routable instance leader and balances across them itself."""
    selector = role_selector(group, spec.role) | {ROUTABLE_LABEL: "true", LWS_WORKER_INDEX_LABEL: "0"}
    port = engine_port(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": leader_service_name(group, spec.role), "namespace": namespace,
                     "labels": labels(group, spec.role, routable=True, pool=False)},
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def disruption_budget(group: InferenceGroup, spec: RoleSpec, namespace: str) -> dict[str, Any]:
    """One pod of a role at a time: evicting any member rebuilds its whole instance."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"{group.name}-{spec.role}", "namespace": namespace,
                     "labels": labels(group, spec.role, routable=True, pool=False)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": role_selector(group, spec.role)}},
    }


def render(group: InferenceGroup, namespace: str, image: str, standby: bool = False) -> list[dict[str, Any]]:
    """Every object of the group: LWSes (serving, then warm pool), leader Services, PDBs."""
    lws = [leader_worker_set(group, spec, namespace, image, routable=not standby, pool=False) for spec in group.roles]
    if group.warm_pool and not standby:
        lws += [leader_worker_set(group, spec, namespace, image, routable=False, pool=True) for spec in group.roles]
    services = [leader_service(group, spec, namespace) for spec in group.roles]
    budgets = [disruption_budget(group, spec, namespace) for spec in group.roles]
    return lws + services + budgets


def render_yaml(group: InferenceGroup, namespace: str, image: str, standby: bool = False) -> str:
    return yaml.safe_dump_all(render(group, namespace, image, standby), sort_keys=False)
