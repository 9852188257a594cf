"""InferenceGroup spec: parsing, validation errors that name the field, member enumeration, shipped specs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.group.argv import serve_argv
from engine.group.spec import GroupSpecError, InferenceGroup, Member
from engine.server.cli import add_commands, engine_config, member_connection_limits

GROUPS = Path(__file__).resolve().parents[3] / "deployments" / "groups"


def pd(**overrides) -> dict:
    spec = {
        "name": "g",
        "version": "v1",
        "model": {"path": "/models/m"},
        "roles": [{"role": "prefill", "instances": 2, "parallel": "DEP2"}, {"role": "decode", "parallel": "DEP1"}],
    }
    return spec | overrides


def error_of(spec: dict) -> str:
    with pytest.raises(ValidationError) as info:
        InferenceGroup.model_validate(spec)
    return str(info.value)


def test_members_enumerate_role_instance_rank_in_order():
    group = InferenceGroup.model_validate(pd(roles=[
        {"role": "decode", "instances": 1, "parallel": "DEP2"},
        {"role": "prefill", "instances": 2, "parallel": "DEP1"},
        {"role": "encoder", "instances": 1},
    ]))
    assert list(group.members()) == [
        Member(role="encoder", instance=0, rank=0, size=1),
        Member(role="prefill", instance=0, rank=0, size=1),
        Member(role="prefill", instance=1, rank=0, size=1),
        Member(role="decode", instance=0, rank=0, size=2),
        Member(role="decode", instance=0, rank=1, size=2),
    ]
    assert group.total_members == 5


def test_parallel_parses_degree_and_strategy():
    group = InferenceGroup.model_validate(pd())
    assert group.role("prefill").members_per_instance == 2
    assert group.role("prefill").strategy == "DEP"
    assert group.role("decode").members_per_instance == 1


@pytest.mark.parametrize("parallel", ["DEP3", "DEP128", "EP2", "dep2", "DEP0", "TP"])
def test_bad_parallel_names_the_field(parallel):
    message = error_of(pd(roles=[{"role": "prefill", "parallel": parallel}, {"role": "decode"}]))
    assert "roles.0.parallel" in message


def test_tensor_parallelism_is_refused_not_replaced_by_dep():
    """TP2 used to start DEP ranks without a word; now the field is named and DEP2 offered instead."""
    message = error_of(pd(roles=[{"role": "prefill"}, {"role": "decode", "parallel": "TP2"}]))
    assert "roles.1.parallel" in message and "not implemented" in message and "DEP2" in message
    one = InferenceGroup.model_validate(pd(roles=[{"role": "prefill"}, {"role": "decode", "parallel": "TP1"}]))
    assert one.role("decode").members_per_instance == 1


@pytest.mark.parametrize("instances", [0, -1, 257, 1_000_000])
def test_instances_outside_1_to_256_are_rejected_naming_the_field(instances):
    """A role with no instance cannot serve an atomic group; a huge count is what a cluster would refuse."""
    assert "roles.1.instances" in error_of(pd(roles=[{"role": "prefill"}, {"role": "decode", "instances": instances}]))
    assert InferenceGroup.model_validate(pd(roles=[{"role": "prefill", "instances": 256}, {"role": "decode"}]))


@pytest.mark.parametrize("roles, needle", [
    ([{"role": "prefill"}], "missing decode"),
    ([{"role": "colocated"}, {"role": "decode"}], "'colocated' must be the only role"),
    ([{"role": "prefill"}, {"role": "decode"}, {"role": "decode"}], "decode listed more than once"),
    ([{"role": "encoder"}, {"role": "decode"}], "missing prefill"),
])
def test_group_shape_rules(roles, needle):
    assert needle in error_of(pd(roles=roles))


def test_colocated_alone_and_encoder_optional():
    assert InferenceGroup.model_validate(pd(roles=[{"role": "colocated"}])).total_members == 1
    with_encoder = InferenceGroup.model_validate(pd(roles=[{"role": "encoder"}, {"role": "prefill"}, {"role": "decode"}]))
    assert [m.role for m in with_encoder.members()] == ["encoder", "prefill", "decode"]


@pytest.mark.parametrize("field, value, loc", [
    ("name", "Bad_Name", "name"),
    ("name", "x" * 41, "name"),
    ("warm_pool", -1, "warm_pool"),
    ("transfer", "rdma", "transfer"),
    ("model", {"path": "/a", "uri": "s3://b/m/v1/"}, "model"),
    ("model", {"uri": "http://example/m"}, "model"),
    ("labels", {"tideflow.dev/group": "x"}, "labels"),
    ("labels", {"team": "not ok!"}, "labels"),
    ("router", {"replicas": 0}, "router.replicas"),
    ("router", {"replicas": 65}, "router.replicas"),
    ("warm_pool", 65, "warm_pool"),
])
def test_bad_fields_are_named(field, value, loc):
    assert loc in error_of(pd(**{field: value}))


@pytest.mark.parametrize("resources, loc", [
    ({"cpu": "lots"}, "roles.0.resources.cpu"),
    ({"memory": "16GB"}, "roles.0.resources.memory"),
    ({"gpus": -1}, "roles.0.resources.gpus"),
])
def test_bad_resources_are_named(resources, loc):
    assert loc in error_of(pd(roles=[{"role": "prefill", "resources": resources}, {"role": "decode"}]))


def test_engine_args_validation():
    both = {"kv_cache_fraction": 0.5, "kv_cache_bytes": 1024}
    assert "give kv_cache_bytes or kv_cache_fraction, not both" in error_of(
        pd(roles=[{"role": "prefill", "engine": both}, {"role": "decode"}]))
    assert "roles.0.engine.block_size" in error_of(pd(roles=[{"role": "prefill", "engine": {"block_size": 24}}, {"role": "decode"}]))
    assert "roles.0.engine.kv_cache_fraction" in error_of(
        pd(roles=[{"role": "prefill", "engine": {"kv_cache_fraction": 1.5}}, {"role": "decode"}]))


def test_model_path_expands_vars_and_home(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDEFLOW_HOME", "/srv/tf")
    monkeypatch.setenv("HOME", str(tmp_path))
    group = InferenceGroup.model_validate(pd(model={"path": "${TIDEFLOW_HOME}/models/default"}))
    assert group.model.expanded_path() == "/srv/tf/models/default"
    assert group.model.path == "${TIDEFLOW_HOME}/models/default"
    assert InferenceGroup.model_validate(pd(model={"path": "~/m"})).model.expanded_path() == str(tmp_path / "m")
    assert group.model.expanded_path({"TIDEFLOW_HOME": "/var/lib/tideflow"}) == "/var/lib/tideflow/models/default"


def test_model_path_unset_variable_named(monkeypatch):
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    message = error_of(pd(model={"path": "${NO_SUCH_VAR}/m"}))
    assert "model" in message and "NO_SUCH_VAR" in message


def test_yaml_round_trip(tmp_path):
    group = InferenceGroup.model_validate(pd(warm_pool=2, labels={"team": "infra"}))
    path = tmp_path / "g.yaml"
    path.write_text(group.to_yaml())
    assert InferenceGroup.from_yaml(path) == group


def test_from_yaml_error_names_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: g\nversion: v1\nmodel: {path: /m}\nroles:\n  - {role: prefill, parallel: DEP6}\n  - {role: decode}\n")
    with pytest.raises(GroupSpecError) as info:
        InferenceGroup.from_yaml(path)
    assert str(path) in str(info.value) and "roles.0.parallel" in str(info.value)
    path.write_text("- not a mapping\n")
    with pytest.raises(GroupSpecError, match="YAML mapping"):
        InferenceGroup.from_yaml(path)
    with pytest.raises(GroupSpecError, match="cannot read"):
        InferenceGroup.from_yaml(tmp_path / "missing.yaml")


def test_unknown_field_rejected():
    assert "roles.0.replicas" in error_of(pd(roles=[{"role": "prefill", "replicas": 2}, {"role": "decode"}]))


@pytest.mark.parametrize("path", sorted(GROUPS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_load(path):
    group = InferenceGroup.from_yaml(path)
    assert group.name == path.stem
    assert group.total_members == len(list(group.members())) > 0


def test_shipped_shapes():
    large = InferenceGroup.from_yaml(GROUPS / "large-4xdep2-dep8.yaml")
    assert (large.role("prefill").instances, large.role("prefill").members_per_instance) == (4, 2)
    assert large.role("decode").members_per_instance == 8
    assert large.role("encoder").instances == 1 and large.warm_pool == 1
    assert all(r.resources.gpus == 1 for r in large.roles)
    assert large.total_members == 1 + 8 + 8
    assert [r.role for r in InferenceGroup.from_yaml(GROUPS / "tiny-pd.yaml").roles] == ["prefill", "decode"]
    assert InferenceGroup.from_yaml(GROUPS / "tiny-dep2.yaml").total_members == 4
    assert InferenceGroup.from_yaml(GROUPS / "tiny-2p1d.yaml").role("prefill").instances == 2


@pytest.mark.parametrize("cpu, threads", [("500m", 1), ("1", 1), ("2", 2), ("2500m", 3), ("1.5", 2), ("100m", 1)])
def test_a_member_computes_on_its_cpu_share_rounded_up(cpu, threads):
    group = InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "resources": {"cpu": cpu}}]))
    spec = group.role("colocated")
    assert spec.resources.threads == threads
    argv = serve_argv(group, spec, model="/m", host="127.0.0.1", port=1, served_name="m")
    assert argv[argv.index("--threads") + 1] == str(threads), "both backends start the member with its share"


@pytest.mark.parametrize("field,value,default", [
    ("lone_arrival_ms", None, 20.0), ("lone_arrival_ms", 0.0, None), ("lone_arrival_ms", 5.0, None),
    ("max_client_tokens", None, None), ("max_client_tokens", 0, None), ("max_client_tokens", 4096, None),
    ("scheduling", "fcfs", None), ("enforce_eager", None, False), ("enforce_eager", True, None),
])
def test_a_member_is_started_with_the_group_s_engine_knobs(field, value, default):
    """The argv carries a knob when the spec changes it, and serve parses it into the engine config."""
    engine = {} if value is None else {field: value}
    group = InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "engine": engine}]))
    argv = serve_argv(group, group.role("colocated"), model="/m", host="127.0.0.1", port=1, served_name="m")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    assert getattr(engine_config(parser.parse_args(argv)), field) == (default if value is None else value)


@pytest.mark.parametrize("engine,cap", [({}, 256 + 64 + 256), ({"max_num_seqs": 8, "max_queue": 1000}, 256 + 8 + 1000),
                                        ({"max_connections_per_address": 4096}, 4096)])
def test_a_member_s_connection_cap_follows_the_group_s_spec(engine, cap):
    """Unset, a member's cap leaves its router a connection per request the engine admits; set, the spec's own."""
    group = InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "engine": engine}]))
    argv = serve_argv(group, group.role("colocated"), model="/m", host="127.0.0.1", port=1, served_name="m")
    assert ("--max-connections-per-address" in argv) == ("max_connections_per_address" in engine)
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert member_connection_limits(args, engine_config(args)).max_connections_per_address == cap


def test_a_role_may_run_its_engine_core_apart_where_it_can():
    group = InferenceGroup.model_validate(pd(roles=[{"role": "colocated",
                                                     "engine": {"engine_core": "process", "api_server_count": 2}}]))
    argv = serve_argv(group, group.role("colocated"), model="/m", host="127.0.0.1", port=1, served_name="m")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(argv)
    assert (args.engine_core, args.api_server_count) == ("process", 2)
    with pytest.raises(ValueError, match="needs one"):
        serve_argv(group, group.role("colocated"), model="/m", host="127.0.0.1", port=1, served_name="m", standby=True)
    with pytest.raises(ValidationError, match="colocated DEP1 roles only"):
        InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "parallel": "DEP2",
                                                 "engine": {"engine_core": "process"}}]))
    with pytest.raises(ValidationError, match="needs engine.engine_core"):
        InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "engine": {"api_server_count": 2}}]))


@pytest.mark.parametrize("roles, needle", [
    ([{"role": "colocated", "instances": 2, "port_base": 65535}], "up to 65536, past 65535"),
    ([{"role": "prefill", "instances": 2, "parallel": "DEP2", "port_base": 65533}, {"role": "decode"}], "65536"),
    ([{"role": "prefill", "instances": 2, "port_base": 9000}, {"role": "decode", "port_base": 9001}],
     "prefill ports 9000-9001 and decode ports 9001-9001 overlap"),
    ([{"role": "prefill", "instances": 256, "parallel": "DEP4"}, {"role": "decode"}], "1025 members in one group"),
])
def test_member_ports_and_counts_are_bounded_in_the_spec(roles, needle):
    """A range past 65535 used to reach the backend and kill the group's supervisor after a spawn."""
    assert needle in error_of(pd(roles=roles))


def test_ports_that_fit_exactly_are_accepted():
    group = InferenceGroup.model_validate(pd(roles=[{"role": "prefill", "instances": 2, "port_base": 65532},
                                                    {"role": "decode", "port_base": 65534, "instances": 2}]))
    assert list(group.role("decode").ports) == [65534, 65535]


@pytest.mark.parametrize("content, needle", [
    ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("name: g\n" + "#" * (1 << 20) + "\n", "at most 1048576 bytes"),
    ("name: [unclosed\nversion: v1\n", "cannot read group spec"),
])
def test_a_hostile_spec_file_is_a_one_line_error(tmp_path, content, needle):
    path = tmp_path / "hostile.yaml"
    path.write_text(content)
    with pytest.raises(GroupSpecError) as info:
        InferenceGroup.from_yaml(path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_role_s_kv_tiers_reach_its_members_and_bad_ones_fail_at_the_spec():
    tiers = {"host_bytes": 1 << 30, "disk_path": "/var/cache/kv", "store_url": "s3://kv-bucket/fleet/"}
    group = InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "engine": {"kv_tiers": tiers}}]))
    argv = serve_argv(group, group.role("colocated"), model="/m", host="127.0.0.1", port=1, served_name="m")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    config = engine_config(parser.parse_args(argv + ["--kv-disk-bytes", str(2 << 30)]))
    assert config.kv_tiers.model_dump(include=set(tiers)) == tiers
    assert config.kv_tiers.disk_bytes == 2 << 30 and config.version == group.version
    with pytest.raises(ValidationError, match="host_bytes"):
        InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "engine": {"kv_tiers": {"disk_path": "/x"}}}]))
    with pytest.raises(ValidationError, match="store_ttl_s"):
        InferenceGroup.model_validate(pd(roles=[{"role": "colocated", "engine": {
            "kv_tiers": {"host_bytes": 1 << 30, "store_ttl_s": 5}}}]))
