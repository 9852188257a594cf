"""Canary rollout: traffic steps gated on per-step metrics, automatic promotion or rollback."""

from engine.canary.metrics import DirectSource, GroupFigures, PrometheusSource
from engine.canary.plan import CanaryPlan, CanaryStep
from engine.canary.rollout import CanaryEvent, CanaryReport, run_canary

__all__ = ["CanaryEvent", "CanaryPlan", "CanaryReport", "CanaryStep", "DirectSource", "GroupFigures",
           "PrometheusSource", "run_canary"]
