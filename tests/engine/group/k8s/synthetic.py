"""The Kubernetes API exchanges under recordings/ are SYNTHETIC: written by hand in the shape of API server
answers (LWS v0.6 on Kubernetes 1.30), never recorded from a cluster (none can be had on these machines).

What they hold of our own making is regenerated from today's manifests (engine/group/k8s/manifests.py),
so they cannot drift from what the backend sends: every LeaderWorkerSet, Service, PodDisruptionBudget and
Pod in them carries today's rendered spec and labels, and every apply or scale request carries the body
the backend must send (the replay server answers only a request whose body matches). What the server
adds (uids, resourceVersions, pod status, node names, LWS pod labels and env) is kept as written.

    python tests/engine/group/k8s/synthetic.py          # rewrite recordings/*.json from today's manifests
    python tests/engine/group/k8s/synthetic.py --check  # exit 1 when a recording is stale (a test does this)
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from engine.group.k8s.manifests import LWS_NAME_LABEL, render
from engine.group.spec import InferenceGroup

RECORDINGS = Path(__file__).parent / "recordings"
NS = "tideflow-test"
IMAGE = "tideflow:test"
GROUP = InferenceGroup.model_validate({
    "name": "demo", "version": "v1", "model": {"uri": "s3://models/models/demo/v1/"},
    "roles": [{"role": "prefill", "parallel": "DEP1", "resources": {"cpu": "1", "memory": "2Gi"}},
              {"role": "decode", "parallel": "DEP2", "resources": {"cpu": "1", "memory": "2Gi"}}],
})
PROVENANCE = ("synthetic: hand-written in the shape of Kubernetes API server responses, never recorded from a "
              "cluster; the objects of our own making are regenerated from engine/group/k8s/manifests.py by "
              "tests/engine/group/k8s/synthetic.py")
SERVER_POD_LABELS = ("leaderworkerset.sigs.k8s.io/", "statefulset.kubernetes.io/", "apps.kubernetes.io/")
POD_SPEC_FROM_TEMPLATE = ("automountServiceAccountToken", "terminationGracePeriodSeconds", "containers",
                          "topologySpreadConstraints", "volumes")


def rendered() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(GROUP, NS, IMAGE)}


def refresh(obj: Any, docs: dict[tuple[str, str], dict[str, Any]]) -> Any:
    """`obj` with today's rendered spec and labels where it is one of ours (recursing into lists and events)."""
    if isinstance(obj, list):
        return [refresh(o, docs) for o in obj]
    if not isinstance(obj, dict):
        return obj
    kind, meta = obj.get("kind"), obj.get("metadata") or {}
    out = {k: refresh(v, docs) for k, v in obj.items()}
    doc = docs.get((kind, meta.get("name")))
    if kind in ("LeaderWorkerSet", "Service", "PodDisruptionBudget") and doc is not None:
        out["metadata"] = {**meta, "labels": doc["metadata"]["labels"]}
        spec = copy.deepcopy(doc["spec"])
        if kind == "LeaderWorkerSet":  # the one default the LWS webhook fills in
            spec["rolloutStrategy"]["rollingUpdateConfiguration"].setdefault("partition", 0)
        if kind == "Service":  # clusterIPs, type, ipFamilies...: what the server adds stays
            spec = {**obj.get("spec", {}), **spec}
        out["spec"] = spec
    elif kind == "Pod" and ("LeaderWorkerSet", (meta.get("labels") or {}).get(LWS_NAME_LABEL)) in docs:
        out = _pod(out, docs["LeaderWorkerSet", meta["labels"][LWS_NAME_LABEL]])
    return out


def _pod(pod: dict[str, Any], lws: dict[str, Any]) -> dict[str, Any]:
    template = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    labels = pod["metadata"]["labels"]
    server_labels = {k: v for k, v in labels.items() if k.startswith(SERVER_POD_LABELS)}
    pod["metadata"] = {**pod["metadata"], "labels": {**template["metadata"]["labels"], **server_labels}}
    spec = {**pod["spec"], **{k: copy.deepcopy(template["spec"][k]) for k in POD_SPEC_FROM_TEMPLATE}}
    lws_env = [e for e in pod["spec"]["containers"][0].get("env", []) if e["name"].startswith("LWS_")]
    spec["containers"][0]["env"] += lws_env  # LWS injects these into every pod it creates
    pod["spec"] = spec
    return pod


def regenerate(recording: dict[str, Any]) -> dict[str, Any]:
    docs = rendered()
    out = {"provenance": PROVENANCE, "namespace": recording["namespace"], "exchanges": []}
    for exchange in recording["exchanges"]:
        exchange = refresh(exchange, docs)
        request, response = exchange["request"], exchange["response"]
        if request["method"] == "PATCH" and request["path"].endswith("/scale"):
            request["body"] = {"spec": {"replicas": response["body"]["spec"]["replicas"]}}
        elif request["method"] == "PATCH":
            body = response["body"]
            request["body"] = docs[body["kind"], body["metadata"]["name"]]
        out["exchanges"].append(exchange)
    return out


def stale() -> list[str]:
    """Names of the recordings that differ from what today's manifests give."""
    names = []
    for path in sorted(RECORDINGS.glob("*.json")):
        recording = json.loads(path.read_text())
        if regenerate(recording) != recording:
            names.append(path.name)
    return names


def main(argv: list[str]) -> int:
    if "--check" in argv:
        names = stale()
        if names:
            print(f"stale recordings: {', '.join(names)}; run python tests/engine/group/k8s/synthetic.py")
        return 1 if names else 0
    for path in sorted(RECORDINGS.glob("*.json")):
        path.write_text(json.dumps(regenerate(json.loads(path.read_text())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
