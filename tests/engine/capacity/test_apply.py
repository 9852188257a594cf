"""A plan as the autoscaler's policy: hourly groups of the template as a schedule with floors, the largest ramp as
the warm pool, the zone of the forecast, the metric part kept."""

from __future__ import annotations

from datetime import time

from engine.capacity.apply import groups_for, policy_from_plan
from engine.capacity.forecast import Forecast
from engine.capacity.plan import plan
from engine.group.spec import InferenceGroup
from engine.scaling.policy import MetricPolicy, ScalingPolicy
from tests.engine.capacity.shapes import SPEC, shape


def template(roles: list[dict]) -> InferenceGroup:
    return InferenceGroup.model_validate({"name": "pool", "version": "v1", "model": {"path": "/m"}, "roles": roles})


PD = template([{"role": "prefill", "instances": 2}, {"role": "decode", "instances": 1}])
COLOCATED = template([{"role": "colocated", "instances": 2}])


def test_members_map_to_groups_by_the_templates_instances():
    assert groups_for(prefill=3, decode=1, template=PD) == 2  # ceil(3 / 2) prefill-bound
    assert groups_for(prefill=1, decode=3, template=PD) == 3  # decode-bound
    assert groups_for(prefill=3, decode=5, template=COLOCATED) == 3  # ceil(max(3, 5) / 2)


def test_the_policy_follows_the_plans_hours_and_keeps_the_metric_part():
    rates = [0.5] * 8 + [30.0] * 10 + [4.0] * 6
    result = plan(SPEC, Forecast(hourly_rps=rates, timezone="Asia/Shanghai"), shape())
    counts = [groups_for(h.prefill.members, h.decode.members, PD) for h in result.hours]
    assert counts[0] < counts[8] and counts[20] < counts[8]  # the forecast's day shows through
    base = ScalingPolicy(metrics=MetricPolicy(), tick_s=5.0)
    policy = policy_from_plan(result, PD, base)
    assert policy.metrics == base.metrics and policy.tick_s == 5.0
    assert policy.schedule.timezone == "Asia/Shanghai"
    assert [(e.at, e.groups, e.floor) for e in policy.schedule.entries] == [
        (time(0), counts[0], counts[0]), (time(8), counts[8], counts[8]), (time(18), counts[18], counts[18])]
    assert policy.warm_pool == counts[8] - counts[7]  # the morning ramp, the day's largest
    assert policy.bounds.min_groups == min(counts) and policy.bounds.max_groups >= max(counts)
