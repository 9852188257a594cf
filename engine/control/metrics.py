"""What the controller knows, as Prometheus series: the lifecycle board and the alerts read them.

The members and the router export what they measure; only the controller sees the fleet's life: each group's
state over time, its rebuilds and why its members failed, how long activations took, what the warm pool
and the autoscaler did, where the canary stands. States, rebuilds, falls, member failures and the canary are
read from the controller at scrape time (a collector), so they are never stale; events the controller lives
through (activations, scale decisions, canary decisions) are counted as they happen.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel

from engine.group.manager import GroupState, GroupStatus
from engine.telemetry.metrics import LATENCY_BUCKETS


ACTIVATION_TRIGGERS = ("api", "pool", "replacement")  # who switched a standby group to serving


class CanaryGauge(BaseModel):
    stable: str
    canary: str
    step: int
    percent: float


class FleetSnapshot(BaseModel):
    """What the collector reads from the controller at each scrape."""

    groups: list[tuple[GroupStatus, float, bool]]  # status, router weight, standby
    canary: CanaryGauge | None = None


class ControllerMetrics:
    """The controller's registry: event counters and histograms, plus a collector over a fleet snapshot."""

    def __init__(self, snapshot: Callable[[], FleetSnapshot]) -> None:
        self.registry = CollectorRegistry()  # every labelled series below exists from the start (0, not absent)
        self.activation = Histogram("tideflow_controller_activation_seconds",
                                    "standby -> serving: the switch of one group, by whatever asked for it",
                                    ["trigger"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.scale = Counter("tideflow_controller_pool_scale_total", "warm-pool decisions applied, by action",
                             ["pool", "action"], registry=self.registry)
        self.canary_decisions = Counter("tideflow_controller_canary_decisions_total", "canary rollouts decided",
                                        ["decision"], registry=self.registry)
        for decision in ("promoted", "rolled_back"):
            self.canary_decisions.labels(decision)
        for trigger in ACTIVATION_TRIGGERS:
            self.activation.labels(trigger)
        self.registry.register(_FleetCollector(snapshot))

    def observe_scale(self, pool: str, activated: int, parked: int, cold_started: int, refilled: int,
                      stopped: int) -> None:
        for action, count in (("activated", activated), ("parked", parked), ("cold_started", cold_started),
                              ("refilled", refilled), ("stopped", stopped)):
            self.scale.labels(pool, action).inc(count)  # every action's series exists once the pool does


class _FleetCollector:
    def __init__(self, snapshot: Callable[[], FleetSnapshot]) -> None:
        self.snapshot = snapshot

    def describe(self) -> Iterable:
        return []  # collected at scrape time only (no registration-time call into the controller)

    def collect(self) -> Iterable:
        snap = self.snapshot()
        state = GaugeMetricFamily("tideflow_controller_group_state",
                                  "1 for the state each group is in now, 0 for the others (a state timeline)",
                                  labels=["group", "version", "state"])
        standby = GaugeMetricFamily("tideflow_controller_group_standby", "1 when the group is kept silent (warm pool)",
                                    labels=["group", "version"])
        weight = GaugeMetricFamily("tideflow_controller_group_weight", "the group's router weight (desired)",
                                   labels=["group", "version"])
        rebuilds = CounterMetricFamily("tideflow_controller_group_rebuilds", "whole-group rebuilds after a failure "
                                       "(fault drills' kills are counted apart)", labels=["group", "version"])
        drills = CounterMetricFamily("tideflow_controller_group_drill_rebuilds",
                                     "whole-group rebuilds after a fault drill killed a member", labels=["group", "version"])
        falls = CounterMetricFamily("tideflow_controller_group_falls", "times the group fell out of routing while serving",
                                    labels=["group", "version"])
        failures = CounterMetricFamily("tideflow_controller_member_failures",
                                       "member failures that made the group rebuild, by reason (exit code)",
                                       labels=["group", "version", "reason"])
        for status, router_weight, silent in snap.groups:
            for s in GroupState:
                state.add_metric([status.name, status.version, s.value], 1.0 if status.state == s else 0.0)
            standby.add_metric([status.name, status.version], 1.0 if silent else 0.0)
            weight.add_metric([status.name, status.version], router_weight)
            rebuilds.add_metric([status.name, status.version], status.rebuilds)
            drills.add_metric([status.name, status.version], status.drill_rebuilds)
            falls.add_metric([status.name, status.version], status.falls)
            for reason, count in sorted(status.member_failures.items()):
                failures.add_metric([status.name, status.version, reason], count)
        yield from (state, standby, weight, rebuilds, drills, falls, failures)
        if snap.canary is not None:
            c = snap.canary
            step = GaugeMetricFamily("tideflow_controller_canary_step", "the canary step being held (-1 before the first)",
                                     labels=["stable", "canary"])
            step.add_metric([c.stable, c.canary], c.step)
            percent = GaugeMetricFamily("tideflow_controller_canary_percent", "the canary's share of traffic, in %",
                                        labels=["stable", "canary"])
            percent.add_metric([c.stable, c.canary], c.percent)
            yield from (step, percent)
