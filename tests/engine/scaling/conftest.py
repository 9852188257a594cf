"""A group set (router process + manager) on loopback with a warm pool over the tiny model, always torn down."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.group.groupset import GroupSetConfig, LocalGroupSet
from engine.group.manager import SupervisionPolicy
from engine.group.spec import InferenceGroup


@pytest.fixture(scope="module")
def groupset(tiny_model_dir, tideflow_home):
    policy = SupervisionPolicy(ready_timeout_s=120, max_restarts=1, backoff_s=0.2)
    with LocalGroupSet(GroupSetConfig(model_dir=Path(tiny_model_dir), model_name="default", policy=policy)) as gs:
        yield gs


@pytest.fixture(scope="module")
def template(tiny_model_dir) -> InferenceGroup:
    return InferenceGroup.model_validate({
        "name": "tide", "version": "v1", "model": {"path": str(tiny_model_dir)}, "warm_pool": 1,
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 4_000_000, "max_wait_ms": 0}}]})
