"""The release pipeline's hold on the shared KV store, against a real controller in its own process: deploy_group
sweeps the store its group will write to, and a version's blocks are removed only once no group runs it."""

from __future__ import annotations

import os
import time

import pytest
import yaml
from prefect import flow

from engine.group.spec import InferenceGroup
from flows.deploy_group import deploy_group
from flows.kv_gc import KVGcParams, kv_gc
from flows.params import DeployParams
from tasks.kv import kv_remove_version, kv_stores

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

DAY = 86400


@pytest.fixture(scope="module")
def controller_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


def block(store, key: str, age_days: float = 0.0):
    path = store / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"block")
    then = time.time() - age_days * DAY
    os.utime(path, (then, then))
    return path


def spec(tiny_model_dir, store, name: str, version: str) -> dict:
    tiers = {"host_bytes": 1 << 20, "store_url": store.as_uri() + "/"}
    return {"name": name, "version": version, "model": {"path": str(tiny_model_dir)},
            "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 8_000_000, "kv_tiers": tiers}}]}


@flow
def remove(group: InferenceGroup) -> list:
    return kv_remove_version(group)


def test_deploy_sweeps_the_store_and_a_version_s_blocks_go_only_once_nobody_runs_it(flow_home, controller, store,
                                                                                    tiny_model_dir, tmp_path):
    expired, fresh = block(store, "kv/default/v0/s/old", age_days=2), block(store, "kv/default/v1/s/new")
    path = tmp_path / "keeper.yaml"
    path.write_text(yaml.safe_dump(spec(tiny_model_dir, store, "kv-keeper", "v1")))
    deploy_group(DeployParams(spec_file=path, weight=1.0))
    assert not expired.exists() and fresh.exists()  # the sweep before the group started

    retired_v2 = block(store, "kv/default/v2/s/a")
    sibling = InferenceGroup.model_validate(spec(tiny_model_dir, store, "kv-sibling", "v1"))
    assert remove(sibling) == [] and fresh.exists()  # kv-keeper still runs v1
    gone = remove(InferenceGroup.model_validate(spec(tiny_model_dir, store, "kv-old", "v2")))
    assert [(s.objects_deleted, s.bytes_freed) for s in gone] == [(1, 5)]
    assert not retired_v2.exists() and fresh.exists()


def test_the_kv_gc_flow_sweeps_the_fleet_s_stores_and_extra_ones(flow_home, controller, tmp_path):
    fleet = kv_stores([g.spec for g in controller.status().groups if g.spec is not None])
    extra = tmp_path / "extra-store"
    old_extra, new_extra = block(extra, "kv/m/v/s/old", age_days=3), block(extra, "kv/m/v/s/new")
    sweeps = kv_gc(KVGcParams(extra_stores={extra.as_uri() + "/": DAY}))
    assert {s.url for s in sweeps} == {*fleet, extra.as_uri() + "/"}
    assert next(s for s in sweeps if s.url == extra.as_uri() + "/").objects_deleted == 1
    assert not old_extra.exists() and new_extra.exists()
