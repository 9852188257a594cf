"""After a promotion, a stable group that cannot be parked in time (a backlog longer than drain_s) stays
at weight 0 and the decision stands: a slow drain is not a failed release."""

from __future__ import annotations

from engine.canary.metrics import GroupFigures
from engine.canary.plan import CanaryPlan
from engine.canary.rollout import StepReport, conclude
from engine.runtime.errors import TideflowError


class Router:
    """The router verbs conclude uses, recording what it was told."""

    url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.weights = {"stable": 100.0, "canary": 0.0}

    def set_weights(self, weights):
        self.weights.update(weights)
        return dict(self.weights)

    def groups(self):
        return [{"name": n, "weight": w, "inflight": 0} for n, w in self.weights.items()]

    def inflight(self, name):
        return 0


class BusyFleet:
    def park(self, name, drain_s):
        raise TideflowError(f"{name}: 128 requests still open after {drain_s}s")

    def delete(self, name, drain_s):
        raise AssertionError("a promotion parks the stable group, it does not delete it")


class Fleet(Router, BusyFleet):
    pass


class Gates:
    name = "suite"


def test_a_stable_group_that_cannot_park_in_time_leaves_the_promotion_standing():
    fleet = Fleet()
    step = StepReport(index=0, percent=100.0, started_at=0.0, elapsed_s=1.0, checks=1, canary=GroupFigures(group="canary"),
                      stable=GroupFigures(group="stable"), baseline_step=0, passed=True)
    report = conclude(fleet, fleet, "stable", "canary", CanaryPlan(drain_s=0.1), [step], "promoted", "all passed",
                      Gates(), lambda e: None)
    assert report.decision == "promoted"
    assert report.weights == {"stable": 0.0, "canary": 100.0}
    assert "stable stays Ready at weight 0" in report.aftermath and "128 requests still open" in report.aftermath
