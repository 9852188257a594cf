"""tidal_scale and autoscaler flows over the controller's warm pool of tiny colocated groups."""

from __future__ import annotations

import pytest

import yaml

from engine.offline.default_model import TINY_CONFIG, write_default_model
from engine.group.manager import GroupState
from engine.scaling.policy import Bounds, Schedule, ScalingPolicy
from flows.tidal_scale import AutoscalerParams, TidalParams, autoscaler, tidal_scale

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def serving(controller) -> list[str]:
    return sorted(g.name for g in controller.status().groups if g.state == GroupState.READY)


def test_tidal_scale_up_uses_the_warm_pool_then_down_parks(flow_home, controller, tmp_path):
    model = write_default_model(tmp_path / "m", TINY_CONFIG)
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump({"name": "pool", "version": "v1", "model": {"path": str(model)},
                                    "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 8_000_000}}]}))
    bounds = Bounds(min_groups=0, max_groups=2)
    up = tidal_scale(TidalParams(target=1, spec_file=spec, bounds=bounds, warm_pool=1))
    assert up.serving + up.cold_starting == 1
    assert serving(controller) == ["pool-0"]  # the run ended once the group served, not when it was asked for
    second = tidal_scale(TidalParams(target=2, spec_file=spec, bounds=bounds, warm_pool=1))
    assert second.serving + second.cold_starting == 2
    for name in second.cold_started + second.activated + up.cold_started + up.activated:
        assert controller.wait_for(name, {GroupState.READY, GroupState.FAILED}, 120).state == GroupState.READY
    assert serving(controller) == ["pool-0", "pool-1"]
    refused = tidal_scale(TidalParams(target=0, floor=0, spec_file=spec, bounds=bounds, warm_pool=1), return_state=True)
    assert refused.is_failed() and "set confirm" in refused.message, refused.message
    assert serving(controller) == ["pool-0", "pool-1"]  # nothing was taken away
    down = tidal_scale(TidalParams(target=0, floor=0, spec_file=spec, bounds=bounds, warm_pool=1, confirm=True))
    assert down.serving == 0 and down.parked
    assert serving(controller) == []
    policy = ScalingPolicy(bounds=bounds, warm_pool=1, tick_s=0.5,
                           schedule=Schedule.model_validate({"timezone": "UTC", "entries": [{"at": "00:00", "groups": 1}]}))
    view = autoscaler(AutoscalerParams(spec_file=spec, policy=policy, run_for_s=3))
    assert view.decisions >= 1 and view.last
    assert controller.wait_for("pool-0", {GroupState.READY}, 60).state == GroupState.READY
    kinds = [e.message.split(" ")[0] for e in controller.events() if e.kind == "autoscaler"]
    assert kinds[-2:] == ["started", "stopped"]  # run_for_s: the flow stopped the policy it started
