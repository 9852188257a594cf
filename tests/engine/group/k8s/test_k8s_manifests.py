"""Rendered manifests validate against the Kubernetes and LWS schemas and carry the group's shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from engine.control import group_cli as cli
from engine.group.k8s.manifests import render, render_yaml
from engine.group.spec import InferenceGroup

GROUPS = Path(__file__).resolve().parents[4] / "deployments" / "groups"


def group(roles, warm_pool=0, **extra) -> InferenceGroup:
    return InferenceGroup.model_validate({"name": "g", "version": "v2", "model": {"uri": "s3://b/models/m/v2/"},
                                          "roles": roles, "warm_pool": warm_pool, **extra})


ONE_P_ONE_D = [{"role": "prefill"}, {"role": "decode"}]
LARGE = [{"role": "prefill", "instances": 4, "parallel": "DEP2", "resources": {"gpus": 1}},
         {"role": "decode", "parallel": "DEP8", "resources": {"gpus": 1}}]
SHAPES = {
    "1p1d": group(ONE_P_ONE_D),
    "1p1d-pool": group(ONE_P_ONE_D, warm_pool=2),
    "4xdep2-dep8": group(LARGE),
    "4xdep2-dep8-encoder-pool": group([{"role": "encoder", "resources": {"gpus": 1}}, *LARGE], warm_pool=1),
    "colocated-dep2": group([{"role": "colocated", "parallel": "DEP2", "engine": {"kv_cache_fraction": 0.7}}]),
    "1p1d-faults": group([{"role": "prefill"}, {"role": "decode", "engine": {"faults": {"token_delay_s": 0.3}}}]),
}


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_object_validates(shape, k8s_validate):
    docs = render(SHAPES[shape], "serving", "registry.local/tideflow:1")
    for doc in docs:
        k8s_validate(doc)
    roles = len(SHAPES[shape].roles)
    pools = roles if SHAPES[shape].warm_pool else 0
    assert [d["kind"] for d in docs] == ["LeaderWorkerSet"] * (roles + pools) + ["Service"] * roles + ["PodDisruptionBudget"] * roles


@pytest.mark.parametrize("path", sorted(GROUPS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_render_valid(path, k8s_validate):
    for doc in render(InferenceGroup.from_yaml(path), "default", "tideflow:latest"):
        k8s_validate(doc)


def test_lws_shape_for_4xdep2_dep8():
    lws = by_kind(render(SHAPES["4xdep2-dep8-encoder-pool"], "ns", "img"), "LeaderWorkerSet")
    assert sorted(lws) == ["g-decode", "g-decode-standby", "g-encoder", "g-encoder-standby", "g-prefill", "g-prefill-standby"]
    prefill = lws["g-prefill"]["spec"]
    assert prefill["replicas"] == 4 and prefill["leaderWorkerTemplate"]["size"] == 2
    assert lws["g-decode"]["spec"]["leaderWorkerTemplate"]["size"] == 8
    assert lws["g-prefill-standby"]["spec"]["replicas"] == 4  # warm_pool (1) x instances (4)
    for obj in lws.values():
        assert obj["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert obj["spec"]["startupPolicy"] == "LeaderReady"
        pod = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_pod_template_probes_env_and_command():
    lws = by_kind(render(SHAPES["1p1d"], "ns", "img:7"), "LeaderWorkerSet")["g-decode"]
    container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert container["image"] == "img:7"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    args = container["command"] + container["args"]
    assert args[:4] == ["tideflow", "serve", "--role", "decode"]
    assert args[args.index("--kv-transport") + 1] == "shm"
    assert args[args.index("--metrics-group") + 1] == "g"
    assert args[args.index("--model") + 1] == "s3://b/models/m/v2/"
    assert "--standby" not in args
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_labels_and_routing():
    docs = render(SHAPES["1p1d-pool"], "ns", "img")
    lws = by_kind(docs, "LeaderWorkerSet")
    serving, pool = lws["g-prefill"], lws["g-prefill-standby"]
    for obj, routable in ((serving, "true"), (pool, "false")):
        pod_labels = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        for labels in (obj["metadata"]["labels"], pod_labels):
            assert labels["app.kubernetes.io/name"] == "tideflow"
            assert (labels["tideflow.dev/group"], labels["tideflow.dev/version"], labels["tideflow.dev/role"]) == ("g", "v2", "prefill")
            assert labels["tideflow.dev/routable"] == routable
    pool_args = pool["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
    assert "--standby" in pool_args
    service = by_kind(docs, "Service")["g-prefill-leaders"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"]["tideflow.dev/routable"] == "true"
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert by_kind(docs, "PodDisruptionBudget")["g-prefill"]["spec"]["maxUnavailable"] == 1


def test_standby_group_is_not_routable_and_has_no_pool():
    lws = by_kind(render(SHAPES["1p1d-pool"], "ns", "img", standby=True), "LeaderWorkerSet")
    assert sorted(lws) == ["g-decode", "g-prefill"]
    assert all(o["metadata"]["labels"]["tideflow.dev/routable"] == "false" for o in lws.values())


def test_schema_check_catches_mistakes(k8s_validate):
    doc = by_kind(render(SHAPES["1p1d"], "ns", "img"), "LeaderWorkerSet")["g-decode"]
    doc["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateOnRestart"
    with pytest.raises(jsonschema.ValidationError):
        k8s_validate(doc)
    doc = by_kind(render(SHAPES["1p1d"], "ns", "img"), "LeaderWorkerSet")["g-decode"]
    doc["spec"]["startupPolicy_typo"] = "LeaderReady"
    with pytest.raises(jsonschema.ValidationError):
        k8s_validate(doc)
    doc = by_kind(render(SHAPES["1p1d"], "ns", "img"), "LeaderWorkerSet")["g-decode"]
    doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(jsonschema.ValidationError):
        k8s_validate(doc)


def test_cli_render_prints_documents(capsys):
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    args = parser.parse_args(["group", "render", str(GROUPS / "tiny-pd.yaml"), "--backend", "kubernetes",
                              "--namespace", "prod", "--image", "img:3"])
    assert args.func(args) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render(InferenceGroup.from_yaml(GROUPS / "tiny-pd.yaml"), "prod", "img:3")
    assert render_yaml(InferenceGroup.from_yaml(GROUPS / "tiny-pd.yaml"), "prod", "img:3").count("\n---\n") == len(docs) - 1


def test_cli_render_reports_bad_spec(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: g\nversion: v1\nmodel: {path: /m}\nroles: [{role: prefill}]\n")
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    args = parser.parse_args(["group", "render", str(bad), "--backend", "kubernetes"])
    assert args.func(args) == 2
    assert "missing decode" in capsys.readouterr().err


def test_dep_ranks_rendezvous_at_their_leader():
    lws = by_kind(render(SHAPES["4xdep2-dep8"], "ns", "img"), "LeaderWorkerSet")["g-decode"]
    args = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
    assert args[args.index("--dep-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert args[args.index("--dep-size") + 1] == "8"
    assert args[args.index("--dist-addr") + 1] == "$(LWS_LEADER_ADDRESS):29500"


def test_members_with_gpus_compute_on_cuda_and_the_others_on_the_cpu():
    """A member that asks for GPUs gets them from the device plugin and is told to use them (--device cuda);
    without the flag it would hold a GPU and compute on the CPU."""
    lws = by_kind(render(SHAPES["4xdep2-dep8"], "ns", "img"), "LeaderWorkerSet")
    for name in ("g-prefill", "g-decode"):
        pod = lws[name]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["args"][pod["args"].index("--device") + 1] == "cuda"
    cpu_only = by_kind(render(SHAPES["1p1d"], "ns", "img"), "LeaderWorkerSet")["g-decode"]
    assert "--device" not in cpu_only["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]


def test_spec_faults_reach_only_their_roles_members():
    """A drill's injected faults travel in the spec: the decode members get --faults, prefill does not."""
    lws = by_kind(render(SHAPES["1p1d-faults"], "ns", "img"), "LeaderWorkerSet")
    args = {name: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
            for name, d in lws.items()}
    assert "--faults" not in args["g-prefill"]
    assert json.loads(args["g-decode"][args["g-decode"].index("--faults") + 1])["token_delay_s"] == 0.3


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_rendered_command_parses_with_todays_cli(shape):
    """The pods run `tideflow serve ...`: every flag the manifests render must exist today."""
    from flows.cli import build_parser

    for lws in by_kind(render(SHAPES[shape], "ns", "img"), "LeaderWorkerSet").values():
        container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        assert container["command"] == ["tideflow"]
        build_parser().parse_args([_expand(a) for a in container["args"]])  # SystemExit on an unknown flag


def _expand(arg: str) -> str:
    """What the kubelet puts in place of $(VAR) (sample values of the right type)."""
    for var, value in (("$(POD_IP)", "10.0.0.7"), ("$(LWS_WORKER_INDEX)", "1"), ("$(LWS_LEADER_ADDRESS)", "g-decode-0.g")):
        arg = arg.replace(var, value)
    return arg
