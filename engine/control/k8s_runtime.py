"""The Kubernetes runtime: groups are LeaderWorkerSets, desired state is a ConfigMap, the router a Deployment.

The controller runs in the cluster as a Deployment (deployments/kubernetes/controller.yaml) with the
least-privilege Role that KubernetesBackend and KubeStore need. It does not run the router: the
router Deployment's replicas watch the controller's route set (`tideflow router --controller-url`),
and Kubernetes restarts them. A restarted controller adopts by re-applying: server-side apply of an
unchanged group changes no pod, so its members keep serving and become Ready at once.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client

from engine.control.kube_store import KubeStore
from engine.control.runtime import ControllerConfig, Runtime
from engine.control.store import effective_groups
from engine.group.backend import BackendError, GroupHandle
from engine.group.k8s.backend import KubernetesBackend, api_client
from engine.group.manager import GroupManager
from engine.runtime.paths import home


class KubernetesRuntime(Runtime):
    def __init__(self, config: ControllerConfig, api: client.ApiClient | None = None,
                 discovery_cache: Path | None = None) -> None:
        api = api or api_client()
        self.config = config
        self.backend = KubernetesBackend(api, namespace=config.namespace, image=config.image,
                                         discovery_cache=discovery_cache or home() / "cache" / "k8s-discovery.json")
        self.store = KubeStore(api, config.namespace)
        self.port, self.url = config.port, f"http://{config.host}:{config.port}"
        self.router_url = config.router_url

    def ensure_router(self) -> list[int]:
        """Nothing to do: the router Deployment is Kubernetes' to keep running (its pods' reports expire by age)."""
        return []

    def router_pids(self) -> list[int]:
        return []

    def kill_router(self) -> tuple[str, bool]:
        raise BackendError("on Kubernetes the router is a Deployment of its own: drill it by deleting one of its "
                           "pods (kubectl delete pod -l app.kubernetes.io/component=router --grace-period=0)")

    def adopt(self, manager: GroupManager | None) -> list[str]:
        """Delete the groups nobody wants any more; re-apply the desired ones (their running pods are left
        as they are, and the group is Ready as soon as its pods are)."""
        desired = effective_groups(self.store)
        for name in sorted(self.backend.running_groups() - set(desired)):
            self.backend.delete(self._handle(name))
            self.store.event("reap", f"deleted group {name}: running, but not desired")
        if manager is None:
            return []
        for want in desired.values():
            manager.up(want.spec, standby=want.standby, weight=want.weight)
        return sorted(desired)

    def stop_leftovers(self) -> int:
        names = sorted(self.backend.running_groups())
        for name in names:
            self.backend.delete(self._handle(name))
        return len(names)

    def _handle(self, name: str) -> GroupHandle:
        return GroupHandle(id=f"{self.config.namespace}/{name}", group=name, version="?", backend=self.backend.name)
