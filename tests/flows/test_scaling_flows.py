"""tidal_scale and autoscaler flows over a warm pool of tiny colocated groups."""

from __future__ import annotations

import yaml

from engine.default_model import TINY_CONFIG, write_default_model
from engine.group.groupset import get_groupset
from engine.group.manager import GroupState
from engine.scaling.policy import Bounds, Schedule, ScalingPolicy
from flows.tidal_scale import AutoscalerParams, TidalParams, autoscaler, tidal_scale


def test_tidal_scale_up_uses_the_warm_pool_then_down_parks(flow_home, tmp_path):
    model = write_default_model(tmp_path / "m", TINY_CONFIG)
    spec = tmp_path / "pool.yaml"
    spec.write_text(yaml.safe_dump({"name": "pool", "version": "v1", "model": {"path": str(model)},
                                    "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 8_000_000}}]}))
    up = tidal_scale(TidalParams(target=1, spec_file=spec, bounds=Bounds(min_groups=0, max_groups=2), warm_pool=1,
                                 groupset="tidal"))
    assert up.serving + up.cold_starting == 1
    second = tidal_scale(TidalParams(target=2, spec_file=spec, bounds=Bounds(min_groups=0, max_groups=2),
                                     warm_pool=1, groupset="tidal"))
    assert second.serving + second.cold_starting == 2
    groups = get_groupset("tidal").manager.groups
    for name in second.cold_started + second.activated + up.cold_started + up.activated:
        assert groups[name].wait_for({GroupState.READY}, 120) == GroupState.READY
    down = tidal_scale(TidalParams(target=0, floor=0, spec_file=spec, bounds=Bounds(min_groups=0, max_groups=2),
                                   warm_pool=1, groupset="tidal"))
    assert down.serving == 0 and down.parked
    policy = ScalingPolicy(bounds=Bounds(min_groups=0, max_groups=2), warm_pool=1, tick_s=0.5,
                           schedule=Schedule.model_validate({"timezone": "UTC", "entries": [{"at": "00:00", "groups": 1}]}))
    decisions = autoscaler(AutoscalerParams(spec_file=spec, policy=policy, run_for_s=3, groupset="tidal"))
    assert decisions >= 1
