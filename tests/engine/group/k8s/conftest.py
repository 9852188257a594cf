"""Fixtures for the Kubernetes tests.

`k8s_validate`: core kinds with kubernetes-validate, LeaderWorkerSets with the vendored CRD schema.

The CRD schema is made strict the way `fieldValidation=Strict` treats it: a field the schema does
not declare is an error (the API server would otherwise prune it silently).
"""

from __future__ import annotations

import copy
import http.server
import importlib.util
import sys
import json
import urllib.parse
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

# The generator of the synthetic recordings, importable by the tests here as `k8s_synthetic` (with
# --import-mode=importlib a test module cannot import its siblings).
_spec = importlib.util.spec_from_file_location("k8s_synthetic", Path(__file__).parent / "synthetic.py")
k8s_synthetic = sys.modules["k8s_synthetic"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(k8s_synthetic)

K8S_VERSION = "1.30"
LWS_SCHEMA = yaml.safe_load((Path(__file__).parent / "schemas" / "leaderworkerset-v1.yaml").read_text())["openAPIV3Schema"]


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


STRICT_LWS = _strict(LWS_SCHEMA)
# metadata is `type: object` in a CRD; the API server checks it as ObjectMeta.
STRICT_LWS["properties"]["metadata"] = {"type": "object"}


def validate(doc: dict[str, Any]) -> None:
    """Raise if `doc` is not a valid object of its kind."""
    if doc["kind"] == "LeaderWorkerSet":
        jsonschema.Draft202012Validator(STRICT_LWS).validate(doc)
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
        kubernetes_validate.validate(meta, K8S_VERSION, strict=True)
        lwt = doc["spec"]["leaderWorkerTemplate"]
        for name in ("leaderTemplate", "workerTemplate"):
            if name in lwt:
                kubernetes_validate.validate(as_pod(lwt[name]), K8S_VERSION, strict=True)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def as_pod(template: dict[str, Any]) -> dict[str, Any]:
    """A PodTemplateSpec wrapped as the Pod it stamps out."""
    pod = copy.deepcopy(template)
    pod.setdefault("metadata", {}).setdefault("name", "template")
    return {"apiVersion": "v1", "kind": "Pod", **pod}


@pytest.fixture
def k8s_validate():
    """validate(doc): raise if doc is not a valid object of its kind."""
    return validate


RECORDINGS = Path(__file__).parent / "recordings"


class ReplayServer:
    """Answers the real kubernetes client with recorded API server responses, and logs what it was sent.

    An exchange matches on method, path, the query items it lists (a watch only matches a watch) and,
    where it has one, the exact request body (so a recording made for other manifests answers 404);
    it is served once in file order unless marked `repeat` (discovery docs are). A watch
    response streams its events one JSON line each; `hold` keeps it open until the request's
    timeoutSeconds, as the API server does.
    """

    def __init__(self, names: list[str]):
        import threading

        self.exchanges: list[dict[str, Any]] = []
        for name in names:
            self.exchanges += json.loads((RECORDINGS / f"{name}.json").read_text())["exchanges"]
        self.used = [False] * len(self.exchanges)
        self.requests: list[dict[str, Any]] = []
        self.configmaps: dict[str, dict[str, Any]] = {}  # name -> ConfigMap: see _configmap
        self.leases: dict[str, dict[str, Any]] = {}  # name -> Lease: see _lease
        self.refuse_leases = False  # the API server is unreachable for Leases: every call answers 503
        self._lease_version = 0  # the resourceVersion of the last Lease write
        self.pod_labels: dict[str, dict[str, str]] = {}  # pod name -> labels merged by PATCH: see _pod_patch
        self.closing = threading.Event()
        self._lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def unused(self) -> list[dict[str, Any]]:
        return [e["request"] for e, used in zip(self.exchanges, self.used) if not used and not e.get("repeat")]

    def sent(self, method: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.requests if method is None or r["method"] == method]

    def _match(self, method: str, path: str, query: dict[str, str], body: Any) -> dict[str, Any] | None:
        with self._lock:
            for i, exchange in enumerate(self.exchanges):
                want = exchange["request"]
                if want["method"] != method or want["path"] != path or (self.used[i] and not exchange.get("repeat")):
                    continue
                wanted_query = want.get("query", {})
                if ("watch" in wanted_query) != ("watch" in query):
                    continue
                if "body" in want and want["body"] != body:
                    continue
                if all(query.get(k) == v for k, v in wanted_query.items()):
                    self.used[i] = True
                    return exchange
        return None

    def _configmap(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """A hand-made, stateful stand-in for the ConfigMap API (not a recording): get, create, and a merge
        patch of `data` where null removes a key, as the API server documents them; enough to check that
        what one KubeStore writes, the next one (a restarted controller) reads back."""
        parts = path.strip("/").split("/")  # api v1 namespaces NS configmaps [NAME]
        name = parts[5] if len(parts) > 5 else (body or {}).get("metadata", {}).get("name")
        have = self.configmaps.get(name)

        def status(code: int, reason: str) -> tuple[int, dict[str, Any]]:
            return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code,
                          "message": f"configmaps {name!r} {reason}"}

        if method == "GET":
            return (200, have) if have else status(404, "NotFound")
        if method == "POST":
            if have:
                return status(409, "AlreadyExists")
            self.configmaps[name] = {"apiVersion": "v1", "kind": "ConfigMap", **body, "data": body.get("data") or {}}
            return 201, self.configmaps[name]
        if method == "PATCH" and have:
            for key, value in (body.get("data") or {}).items():
                if value is None:
                    have["data"].pop(key, None)
                else:
                    have["data"][key] = value
            return 200, have
        return status(404, "NotFound")

    def _lease(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """A hand-made, stateful stand-in for the Lease API (not a recording): get, create, and a replace that
        the API server refuses with 409 Conflict unless it carries the resourceVersion now stored (optimistic
        concurrency, as documented); every write gets a new resourceVersion."""
        parts = path.strip("/").split("/")  # apis coordination.k8s.io v1 namespaces NS leases [NAME]
        name = parts[6] if len(parts) > 6 else (body or {}).get("metadata", {}).get("name")
        with self._lock:
            have = self.leases.get(name)

            def status(code: int, reason: str) -> tuple[int, dict[str, Any]]:
                return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                              "code": code, "message": f"leases.coordination.k8s.io {name!r} {reason}"}

            if self.refuse_leases:
                return status(503, "ServiceUnavailable")
            self._lease_version += method in ("POST", "PUT")
            stored = {**(body or {}), "apiVersion": "coordination.k8s.io/v1", "kind": "Lease"}
            stored["metadata"] = {**stored.get("metadata", {}), "resourceVersion": str(self._lease_version)}
            if method == "GET":
                return (200, have) if have else status(404, "NotFound")
            if method == "POST":
                if have:
                    return status(409, "AlreadyExists")
                self.leases[name] = stored
                return 201, stored
            if method == "PUT" and have:
                if (body.get("metadata") or {}).get("resourceVersion") != have["metadata"]["resourceVersion"]:
                    return status(409, "Conflict")
                self.leases[name] = stored
                return 200, stored
            return status(404, "NotFound")

    def _pod_patch(self, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """A hand-made stand-in for a merge patch of a pod's labels (not a recording): the labels are kept, and
        the answer is the pod's metadata as the API server would hold it after the patch."""
        name = path.strip("/").split("/")[5]  # api v1 namespaces NS pods NAME
        with self._lock:
            labels = self.pod_labels.setdefault(name, {})
            labels.update((body or {}).get("metadata", {}).get("labels", {}))
            return 200, {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": name, "namespace": k8s_synthetic.NS, "labels": dict(labels)}}

    def _handler(self):
        replay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self):
                url = urllib.parse.urlsplit(self.path)
                query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = _parse_body(raw, self.headers.get("Content-Type") or "")
                replay.requests.append({"method": self.command, "path": url.path, "query": query,
                                        "content_type": self.headers.get("Content-Type"), "body": body})
                if "/configmaps" in url.path:
                    return self._json(*replay._configmap(self.command, url.path, body))
                if "/leases" in url.path:
                    return self._json(*replay._lease(self.command, url.path, body))
                if self.command == "PATCH" and "/pods/" in url.path:
                    return self._json(*replay._pod_patch(url.path, body))
                exchange = replay._match(self.command, url.path, query, body)
                if exchange is None:
                    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                              "message": f"no recorded response for {self.command} {url.path} {query} with this body"}
                    return self._json(404, status)
                response = exchange["response"]
                if "stream" not in response:
                    return self._json(response["status"], response["body"])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Connection", "close")
                self.end_headers()
                for event in response["stream"]:
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()
                if response.get("hold"):
                    replay.closing.wait(float(query.get("timeoutSeconds", 0)))
                self.close_connection = True

            def _json(self, code: int, body: Any):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_DELETE = do_POST = do_PUT = _serve

        return Handler


def _parse_body(raw: bytes, content_type: str) -> Any:
    """JSON, or the YAML of a server-side apply (application/apply-patch+yaml; JSON is YAML too)."""
    if not raw:
        return None
    return yaml.safe_load(raw) if "yaml" in content_type else json.loads(raw)


@pytest.fixture
def replay():
    """replay(*recordings) -> a started ReplayServer; all are closed at teardown."""
    servers: list[ReplayServer] = []

    def start(*names: str) -> ReplayServer:
        servers.append(ReplayServer(list(names)))
        return servers[-1]

    try:
        yield start
    finally:
        for server in servers:
            server.close()
