"""Canary rollout: traffic steps judged on per-request samples, automatic promotion or rollback."""

from engine.canary.metrics import DirectSource, GroupFigures, PrometheusSource
from engine.canary.plan import CanaryPlan, CanaryStep
from engine.canary.rollout import CanaryEvent, CanaryReport

__all__ = ["CanaryEvent", "CanaryPlan", "CanaryReport", "CanaryStep", "DirectSource", "GroupFigures",
           "PrometheusSource"]
