"""A capacity plan as the autoscaler's policy: its hourly member counts become a schedule of serving groups of
one template, each hour's count also the floor metric scaling may not go under, and the largest ramp the warm
pool, so the existing scheduled and metric scaling follow the plan.

Members map to groups by the template's instances: a group of `p` prefill and `d` decode instances serves
ceil(prefill / p) or ceil(decode / d) groups' worth, whichever is more. A colocated instance does both jobs, so
a colocated template needs ceil(max(prefill, decode) / its instances) groups: the plan's separate counts are
each a load one member kind must carry, and a colocated member carries both on the same cores, which the
plan's profiles (measured on one member doing both) already price in.
"""

from __future__ import annotations

import math
from datetime import time

from engine.capacity.plan import CapacityPlan
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds, Schedule, ScheduleEntry, ScalingPolicy


def groups_for(prefill: int, decode: int, template: InferenceGroup) -> int:
    instances = {r.role: r.instances for r in template.roles}
    if "colocated" in instances:
        return math.ceil(max(prefill, decode) / instances["colocated"])
    # a valid spec without a colocated role has both prefill and decode (InferenceGroup refuses anything else)
    return max(math.ceil(prefill / instances["prefill"]), math.ceil(decode / instances["decode"]))


def policy_from_plan(plan: CapacityPlan, template: InferenceGroup, base: ScalingPolicy | None = None) -> ScalingPolicy:
    """`base`: the metric part and the tick to keep (its schedule, bounds and warm pool are replaced)."""
    base = base or ScalingPolicy()
    counts = [groups_for(h.prefill.members, h.decode.members, template) for h in plan.hours]
    ceiling = max(max(counts), base.bounds.max_groups)  # metric scaling may still add up to the base's ceiling
    entries = [ScheduleEntry(at=time(hour=h), groups=n, floor=n) for h, n in enumerate(counts)
               if h == 0 or n != counts[h - 1]]
    ramps = [counts[(h + 1) % 24] - counts[h] for h in range(24)]
    return base.model_copy(update={
        "bounds": Bounds(min_groups=min(counts), max_groups=ceiling),
        "schedule": Schedule(timezone=plan.forecast.timezone, entries=entries),
        "warm_pool": max(0, *ramps)})
