"""A group set (router process + manager) on loopback, torn down whatever the test did."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.group.groupset import GroupSetConfig, LocalGroupSet
from engine.group.manager import SupervisionPolicy
from engine.group.spec import InferenceGroup


@pytest.fixture(scope="module")
def groupset(tiny_model_dir, tideflow_home):
    policy = SupervisionPolicy(ready_timeout_s=120, max_restarts=2, backoff_s=0.2)
    with LocalGroupSet(GroupSetConfig(model_dir=Path(tiny_model_dir), model_name="default", policy=policy)) as gs:
        yield gs


@pytest.fixture
def make_spec(tiny_model_dir):
    """Build a small InferenceGroup over the tiny model: make_spec(name, prefill=1, colocated=False, ...)."""
    return lambda name, **kw: group_spec(name, tiny_model_dir, **kw)


def group_spec(name: str, model_dir, *, prefill: int = 1, transfer: str = "shm", colocated: bool = False,
               kv_bytes: int = 16_000_000, decode_kv_bytes: int | None = None) -> InferenceGroup:
    engine = {"kv_cache_bytes": kv_bytes, "max_wait_ms": 0}
    if colocated:
        roles = [{"role": "colocated", "engine": engine}]
    else:
        roles = [{"role": "prefill", "instances": prefill, "engine": engine},
                 {"role": "decode", "engine": {**engine, "kv_cache_bytes": decode_kv_bytes or kv_bytes}}]
    return InferenceGroup.model_validate({"name": name, "version": "v1", "model": {"path": str(model_dir)},
                                          "transfer": transfer, "roles": roles})
