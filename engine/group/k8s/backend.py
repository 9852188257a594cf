"""KubernetesBackend: groups as LeaderWorkerSets, applied server-side, observed through watches.

LWS does the rebuilding (RecreateGroupOnPodRestart); this backend only reports it: a member
whose pod UID changes was recreated, and counts one restart per change it has seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kubernetes import client, config, dynamic, watch
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError

from engine.group.backend import Backend, BackendError, GroupHandle, MemberIdentity, MemberStatus, Phase
from engine.group.k8s.manifests import (
    GROUP_LABEL, LWS_API_VERSION, LWS_GROUP, LWS_GROUP_INDEX_LABEL, LWS_PLURAL, LWS_VERSION,
    LWS_WORKER_INDEX_LABEL, NAME_LABEL, POOL_LABEL, ROLE_LABEL, render,
)
from engine.group.spec import InferenceGroup, Role

FIELD_MANAGER = "tideflow"
DEFAULT_IMAGE = "tideflow:latest"
POD_EXIT_GRACE_S = 90  # terminationGracePeriodSeconds (60) plus time for the kubelet to report
KINDS_OWNED = ((LWS_API_VERSION, "LeaderWorkerSet"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"))
MemberKey = tuple[str, int, int]
Pods = dict[str, dict[str, Any]]  # pod uid -> pod object


class KubernetesBackend(Backend):
    """Runs each role of a group as a LeaderWorkerSet in one namespace."""

    name = "kubernetes"

    def __init__(self, api_client: client.ApiClient, namespace: str = "default", image: str = DEFAULT_IMAGE,
                 discovery_cache: Path | None = None):
        self.namespace = namespace
        self.image = image
        self._custom = client.CustomObjectsApi(api_client)
        try:
            self._dyn = dynamic.DynamicClient(api_client, cache_file=str(discovery_cache) if discovery_cache else None)
        except (ApiException, DynamicApiError) as exc:
            raise BackendError(f"API discovery at {api_client.configuration.host} failed: {_reason(exc)}") from None
        self._resources: dict[tuple[str, str], Any] = {}
        self._uids: dict[MemberKey, str] = {}
        self._recreated: dict[MemberKey, int] = {}

    def running_groups(self) -> set[str]:
        """Names of every group that has a LeaderWorkerSet in the namespace (what a restarted controller finds)."""
        return {o["metadata"]["labels"][GROUP_LABEL] for o in self._list(LWS_API_VERSION, "LeaderWorkerSet",
                                                                          f"{NAME_LABEL}=tideflow")[0].values()}

    def start(self, group: InferenceGroup, standby: bool = False) -> GroupHandle:
        for doc in render(group, self.namespace, self.image, standby=standby):
            self._call(f"apply {doc['kind']} {doc['metadata']['name']}", lambda: self._resource(doc["apiVersion"], doc["kind"]).server_side_apply(
                body=doc, namespace=self.namespace, field_manager=FIELD_MANAGER, force_conflicts=True))
        return GroupHandle(id=f"{self.namespace}/{group.name}", group=group.name, version=group.version,
                           backend=self.name, standby=standby)

    def members(self, handle: GroupHandle) -> list[MemberStatus]:
        pods = self._list("v1", "Pod", _serving(handle))[0]
        self._observe(pods.values())
        return sorted((self._status(p) for p in _current(pods).values()), key=lambda m: (m.role, m.instance, m.rank))

    def identities(self, handle: GroupHandle) -> list[MemberIdentity]:
        pods = _current(self._list("v1", "Pod", _serving(handle))[0])
        out = [MemberIdentity(role=_key(p)[0], instance=_key(p)[1], rank=_key(p)[2],  # type: ignore[arg-type]
                              id=f"pod {p['metadata']['name']} {uid}") for uid, p in pods.items()]
        return sorted(out, key=lambda i: (i.role, i.instance, i.rank))

    def kill(self, handle: GroupHandle, member: MemberIdentity, confirm_s: float = 10.0) -> bool:
        """Delete the member's pod with no grace period; LWS then recreates its whole instance."""
        _, name, uid = member.id.split(" ")
        self._call(f"delete pod {name}", lambda: self._resource("v1", "Pod").delete(
            name=name, namespace=self.namespace, body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}))
        return self._wait_pods(_serving(handle), lambda pods: uid not in pods, confirm_s)

    def wait_ready(self, handle: GroupHandle, timeout_s: float) -> bool:
        lws = self._list(LWS_API_VERSION, "LeaderWorkerSet", _serving(handle))[0].values()
        expected = sum(o["spec"].get("replicas", 1) * o["spec"]["leaderWorkerTemplate"].get("size", 1) for o in lws)
        if not lws:
            raise BackendError(f"group {handle.id} has no LeaderWorkerSet; start it first")

        def ready(pods: Pods) -> bool:
            current = _current(pods).values()
            return len(current) == expected and all(_pod_ready(p) for p in current)

        return self._wait_pods(_serving(handle), ready, timeout_s)

    def stop(self, handle: GroupHandle, drain_s: float) -> None:
        for name in self._list("v1", "Service", _serving(handle))[0]:
            self._delete("v1", "Service", name)
        time.sleep(max(drain_s, 0.0))  # the router drops the endpoints; in-flight requests finish
        for name in self._list(LWS_API_VERSION, "LeaderWorkerSet", _serving(handle))[0]:
            self._scale(name, 0)
        if not self._wait_pods(_serving(handle), lambda pods: not pods, POD_EXIT_GRACE_S):
            raise BackendError(f"group {handle.id}: members still running {POD_EXIT_GRACE_S}s after scale to 0; "
                               f"check `kubectl -n {self.namespace} get pods -l {GROUP_LABEL}={handle.group}`")

    def scale(self, group_name: str, role: Role, instances: int) -> None:
        if instances < 0:
            raise BackendError(f"instances must be >= 0, got {instances}")
        self._scale(f"{group_name}-{role}", instances)

    def delete(self, handle: GroupHandle) -> None:
        selector = f"{GROUP_LABEL}={handle.group}"
        for api_version, kind in KINDS_OWNED:
            for name in self._list(api_version, kind, selector)[0]:
                self._delete(api_version, kind, name)
        if not self._wait_pods(selector, lambda pods: not pods, POD_EXIT_GRACE_S):
            raise BackendError(f"group {handle.id}: pods left {POD_EXIT_GRACE_S}s after deletion; "
                               f"check `kubectl -n {self.namespace} get pods -l {selector}`")

    def _scale(self, name: str, replicas: int) -> None:
        self._call(f"scale LeaderWorkerSet {name}", lambda: self._custom.patch_namespaced_custom_object_scale(
            LWS_GROUP, LWS_VERSION, self.namespace, LWS_PLURAL, name, {"spec": {"replicas": replicas}}))

    def _delete(self, api_version: str, kind: str, name: str) -> None:
        try:
            self._resource(api_version, kind).delete(name=name, namespace=self.namespace, propagation_policy="Foreground")
        except DynamicApiError as exc:
            if exc.status != 404:
                raise BackendError(f"delete {kind} {name} in {self.namespace}: {_reason(exc)}") from None

    def _resource(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        if key not in self._resources:
            try:
                self._resources[key] = self._dyn.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                hint = " (install LWS: see deployments/kubernetes/README.md)" if kind == "LeaderWorkerSet" else ""
                raise BackendError(f"the API server does not serve {kind} in {api_version}{hint}") from None
        return self._resources[key]

    def _list(self, api_version: str, kind: str, selector: str) -> tuple[dict[str, dict[str, Any]], str]:
        """Objects by name (pods: by uid) matching `selector`, and the list's resourceVersion for a watch."""
        listed = self._call(f"list {kind}", lambda: self._resource(api_version, kind).get(
            namespace=self.namespace, label_selector=selector)).to_dict()
        key = "uid" if kind == "Pod" else "name"
        return {o["metadata"][key]: o for o in listed.get("items") or []}, listed["metadata"]["resourceVersion"]

    def _wait_pods(self, selector: str, done: Callable[[Pods], bool], timeout_s: float) -> bool:
        """List, then watch pods until `done(pods)` or the deadline; relists if the server ends a watch early."""
        deadline = time.monotonic() + timeout_s
        while True:
            pods, version = self._list("v1", "Pod", selector)
            self._observe(pods.values())
            if done(pods):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            watcher = watch.Watch()
            events = self._resource("v1", "Pod").watch(namespace=self.namespace, label_selector=selector,
                                                        resource_version=version, timeout=max(1, int(remaining)),
                                                        watcher=watcher)
            try:
                for event in events:
                    pod = event["raw_object"]
                    if event["type"] == "DELETED":
                        pods.pop(pod["metadata"]["uid"], None)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        pods[pod["metadata"]["uid"]] = pod
                        self._observe([pod])
                    if done(pods):
                        return True
                    if time.monotonic() >= deadline:
                        return False
            except (ApiException, DynamicApiError) as exc:
                if getattr(exc, "status", None) != 410:  # 410 Gone: our version expired; relist
                    raise BackendError(f"watch pods ({selector}): {_reason(exc)}") from None
            finally:
                watcher.stop()

    def _observe(self, pods: Iterable[dict[str, Any]]) -> None:
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            key, uid = _key(pod), pod["metadata"]["uid"]
            seen = self._uids.get(key)
            if seen is not None and seen != uid:
                self._recreated[key] = self._recreated.get(key, 0) + 1
            self._uids[key] = uid

    def _status(self, pod: dict[str, Any]) -> MemberStatus:
        role, instance, rank = _key(pod)
        status = pod.get("status") or {}
        containers = status.get("containerStatuses") or []
        in_place = sum(c.get("restartCount", 0) for c in containers)
        ip, port = status.get("podIP"), _http_port(pod)
        return MemberStatus(role=role, instance=instance, rank=rank,  # type: ignore[arg-type]
                            endpoint=f"http://{ip}:{port}" if ip and port else None,
                            phase=_phase(pod), restarts=in_place + self._recreated.get((role, instance, rank), 0),
                            message=_message(pod), exit_code=_exit_code(pod))

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (ApiException, DynamicApiError) as exc:
            raise BackendError(f"{what} in namespace {self.namespace}: {_reason(exc)}") from None


def api_client(context: str | None = None) -> client.ApiClient:
    """$KUBECONFIG (or ~/.kube/config), else the in-cluster service account when running in a pod."""
    try:
        return config.new_client_from_config(context=context)
    except config.ConfigException:
        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            raise BackendError(f"no Kubernetes API to talk to: no usable KUBECONFIG and not in a pod ({exc})") from None
        return client.ApiClient()


def _serving(handle: GroupHandle) -> str:
    """Selector of the handle's own members: the group's LWSes, not its warm pool."""
    return f"{GROUP_LABEL}={handle.group},{POOL_LABEL}=false"


def _key(pod: dict[str, Any]) -> MemberKey:
    labels = pod["metadata"].get("labels") or {}
    return labels[ROLE_LABEL], int(labels[LWS_GROUP_INDEX_LABEL]), int(labels[LWS_WORKER_INDEX_LABEL])


def _current(pods: Pods) -> Pods:
    """One pod per member: while LWS recreates an instance, its terminating pods give way to the new ones."""
    best: dict[MemberKey, dict[str, Any]] = {}
    for pod in pods.values():
        key, old = _key(pod), best.get(_key(pod))
        rank = (not pod["metadata"].get("deletionTimestamp"), pod["metadata"].get("creationTimestamp") or "")
        if old is None or rank > (not old["metadata"].get("deletionTimestamp"), old["metadata"].get("creationTimestamp") or ""):
            best[key] = pod
    return {p["metadata"]["uid"]: p for p in best.values()}


def _pod_ready(pod: dict[str, Any]) -> bool:
    return _phase(pod) is Phase.READY


def _phase(pod: dict[str, Any]) -> Phase:
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp"):
        return Phase.EXITED
    phase = status.get("phase")
    if phase == "Succeeded":
        return Phase.EXITED
    if phase == "Failed" or any(_crashing(c) for c in status.get("containerStatuses") or []):
        return Phase.FAILED
    if phase != "Running":
        return Phase.PENDING
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return Phase.READY if ready else Phase.RUNNING


def _crashing(container: dict[str, Any]) -> bool:
    waiting = (container.get("state") or {}).get("waiting") or {}
    return waiting.get("reason") in ("CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError")


def _exit_code(pod: dict[str, Any]) -> int | None:
    """The engine container's exit status: of its current run when it ended, else of its last one."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        ended = (container.get("state") or {}).get("terminated") or (container.get("lastState") or {}).get("terminated")
        if ended and ended.get("exitCode") is not None:
            return int(ended["exitCode"])
    return None


def _message(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        for kind in ("waiting", "terminated"):
            if state.get(kind):
                detail = state[kind]
                return f"{container['name']} {kind}: {detail.get('reason', '')} {detail.get('message', '')}".strip()
        last = (container.get("lastState") or {}).get("terminated")
        if last:
            return f"{container['name']} restarted after {last.get('reason', 'exit')} (exit {last.get('exitCode')})"
    for cond in status.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("message"):
            return f"{cond['type']}: {cond['message']}"
    return status.get("message", "")


def _http_port(pod: dict[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return port["containerPort"]
    return None


def _reason(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    summary = getattr(exc, "summary", None)
    text = summary() if callable(summary) else (getattr(exc, "reason", None) or str(exc))
    return f"HTTP {status}: {text}" if status else str(text)

