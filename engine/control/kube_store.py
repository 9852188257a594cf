"""Desired state on Kubernetes: one ConfigMap in the fleet's namespace, so a controller pod restart loses nothing.

Why a ConfigMap and not annotations on the LeaderWorkerSets alone (as DESIGN.md first had it): desired
state must outlive the objects it describes. A group being rebuilt has no pods, a group being deleted
must stay known until it has drained, and autoscaler policies and the last canary describe no LWS
at all. The LWSes still carry the group's labels, which is how a restarted controller finds what runs.

The controller that holds the Lease (engine/control/leader.py) is this ConfigMap's only writer: a replica
reads it once it leads, keeps it in memory, and writes through with one merge patch per change; keys:
`group.<name>`, `decision.<name>`, `autoscaler.<name>`, `canary`, `lease` (the flow runs' fleet lease,
not the leader's), `setting.<name>`, `events`.

Keys are not kept here: they come from a Secret mounted as environment variables
(`TIDEFLOW_SECRET_<NAME>`, see deployments/kubernetes/controller.yaml).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from engine.control.store import DesiredGroup, Event, GroupDecision
from engine.runtime.errors import TideflowError
from engine.group.k8s.manifests import KEYS_SECRET

log = logging.getLogger(__name__)

CONFIGMAP = "tideflow-controller-state"
SECRET_ENV_PREFIX = "TIDEFLOW_SECRET_"
EVENTS_KEPT = 300


class StoreError(TideflowError):
    """The state ConfigMap could not be read or written; the message names the API's answer."""


def secret_env(name: str) -> str:
    return SECRET_ENV_PREFIX + name.upper()


class KubeStore:
    def __init__(self, api_client: client.ApiClient, namespace: str, name: str = CONFIGMAP,
                 environ: Mapping[str, str] = os.environ) -> None:
        self._core = client.CoreV1Api(api_client)
        self.namespace, self.name, self._environ = namespace, name, environ
        self._lock = threading.Lock()
        self._data = self._load()
        self._events = [Event.model_validate(e) for e in json.loads(self._data.get("events", "[]"))]

    def _load(self) -> dict[str, str]:
        try:
            return dict(self._core.read_namespaced_config_map(self.name, self.namespace).data or {})
        except ApiException as exc:
            if exc.status != 404:
                raise StoreError(f"read ConfigMap {self.namespace}/{self.name}: HTTP {exc.status} {exc.reason}") from None
        body = client.V1ConfigMap(metadata=client.V1ObjectMeta(
            name=self.name, labels={"app.kubernetes.io/name": "tideflow", "app.kubernetes.io/component": "controller"}),
            data={})
        try:
            self._core.create_namespaced_config_map(self.namespace, body)
        except ApiException as exc:
            raise StoreError(f"create ConfigMap {self.namespace}/{self.name}: HTTP {exc.status} {exc.reason}") from None
        return {}

    def _write(self, changes: dict[str, str | None]) -> None:
        """One merge patch: a None value removes its key. Memory follows only what the API accepted."""
        with self._lock:
            try:
                self._core.patch_namespaced_config_map(self.name, self.namespace, {"data": changes})
            except ApiException as exc:
                raise StoreError(f"update ConfigMap {self.namespace}/{self.name}: HTTP {exc.status} {exc.reason}") from None
            for key, value in changes.items():
                if value is None:
                    self._data.pop(key, None)
                else:
                    self._data[key] = value

    def _remove(self, key: str) -> bool:
        """Drop `key`; False when it was not there (nothing is written then)."""
        known = key in self._data
        if known:
            self._write({key: None})
        return known

    def _prefixed(self, prefix: str) -> dict[str, str]:
        with self._lock:
            return {k[len(prefix):]: v for k, v in sorted(self._data.items()) if k.startswith(prefix)}

    # -- desired groups --------------------------------------------------------------------------
    def put_group(self, desired: DesiredGroup) -> None:
        self._write({f"group.{desired.spec.name}": desired.model_dump_json()})

    def delete_group(self, name: str) -> bool:
        self._remove(f"decision.{name}")
        return self._remove(f"group.{name}")

    def groups(self) -> dict[str, DesiredGroup]:
        return {name: DesiredGroup.model_validate_json(v) for name, v in self._prefixed("group.").items()}

    def put_decision(self, name: str, decision: GroupDecision | None) -> None:
        if decision is None:
            self._remove(f"decision.{name}")
        else:
            self._write({f"decision.{name}": decision.model_dump_json()})

    def decisions(self) -> dict[str, GroupDecision]:
        return {name: GroupDecision.model_validate_json(v) for name, v in self._prefixed("decision.").items()}

    # -- autoscaler policies and the last canary ---------------------------------------------------------
    def put_autoscaler(self, name: str, body_json: str) -> None:
        self._write({f"autoscaler.{name}": body_json})

    def delete_autoscaler(self, name: str) -> bool:
        return self._remove(f"autoscaler.{name}")

    def autoscalers(self) -> dict[str, str]:
        return self._prefixed("autoscaler.")

    def put_canary(self, body_json: str) -> None:
        self._write({"canary": body_json})

    def canary(self) -> str | None:
        return self._data.get("canary")

    def put_lease(self, body_json: str | None) -> None:
        self._write({"lease": body_json})

    def lease(self) -> str | None:
        return self._data.get("lease")

    # -- keys and events -----------------------------------------------------------------------------------
    def secret(self, name: str) -> str:
        value = self._environ.get(secret_env(name), "").strip()
        if not value:
            raise StoreError(f"{secret_env(name)} is not set: the controller reads its keys from Secret "
                             f"{KEYS_SECRET} (key {name.replace('_', '-')}); see deployments/kubernetes/README.md")
        return value

    def event(self, kind: str, message: str) -> None:
        """Kept with the state, the newest EVENTS_KEPT; an event that cannot be written is logged, not raised
        (the change it describes has happened)."""
        with self._lock:
            self._events = (self._events + [Event(at=time.time(), kind=kind, message=message[:500])])[-EVENTS_KEPT:]
            body = json.dumps([e.model_dump() for e in self._events])
        try:
            self._write({"events": body})
        except StoreError as exc:
            log.warning("event not stored (%s): %s %s", exc, kind, message)

    def events(self, limit: int = 200) -> list[Event]:
        with self._lock:
            return list(self._events[-limit:])

    def close(self) -> None:
        """Nothing to release: every change is written when it is made."""
