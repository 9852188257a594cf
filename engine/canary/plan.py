"""CanaryPlan: the traffic steps of a rollout, how long each is held, the gate suite, and what follows."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.canary.judge import JudgeConfig

DEFAULT_SUITE = Path(str(files("engine.canary") / "canary_suite.json"))  # package data (importlib.resources)


class CanaryStep(BaseModel):
    """One traffic share and its hold: the step passes when the judge passes every metric, after `hold_s` (or
    before, on confidence bounds clear of the margins); it rolls back on a failed metric at once, or at
    `max_hold_s` when a metric is still inconclusive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    percent: float = Field(gt=0, le=100, description="canary share of the two groups' traffic, in percent")
    hold_s: float = Field(60.0, gt=0, description="least seconds the step is held before it passes on the horizon")
    max_hold_s: float = Field(600.0, gt=0, description="roll back if a metric is still inconclusive by then")

    @model_validator(mode="after")
    def _max_after_hold(self) -> "CanaryStep":
        if self.max_hold_s < self.hold_s:
            raise ValueError(f"max_hold_s ({self.max_hold_s}) must be >= hold_s ({self.hold_s})")
        return self


class CanaryPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: list[CanaryStep] = Field(
        default_factory=lambda: [CanaryStep(percent=p) for p in (5, 25, 50, 100)],
        description="increasing canary shares ending at 100; a bare number is a step with the default hold",
    )
    check_interval_s: float = Field(1.0, gt=0, description="how often the judge looks during a hold")
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="allowed degradations, alpha, samples, horizon")
    suite: Path | None = Field(None, description="Great Expectations suite (JSON) run on the judge table; None: the "
                                                "packaged engine/canary/canary_suite.json")
    on_promote: Literal["park", "remove"] = Field(
        "park", description="the stable group after promotion: drained and parked in the warm pool (Standby) when the "
                            "rollout runs on a group set, left registered at weight 0 with only a router; or drained and removed")
    on_rollback: Literal["keep", "remove"] = Field(
        "keep", description="the canary after a rollback: kept at weight 0 for inspection, or drained and removed")
    drain_s: float = Field(30.0, ge=0, description="longest wait for in-flight requests of a group leaving traffic")

    @field_validator("steps", mode="before")
    @classmethod
    def _bare_numbers(cls, value):
        if isinstance(value, list):
            return [{"percent": v} if isinstance(v, (int, float)) else v for v in value]
        return value

    @field_validator("steps")
    @classmethod
    def _increasing_to_100(cls, steps: list[CanaryStep]) -> list[CanaryStep]:
        if not steps:
            raise ValueError("a plan needs at least one step")
        shares = [s.percent for s in steps]
        if any(b <= a for a, b in zip(shares, shares[1:])):
            raise ValueError(f"step percents must increase strictly, got {shares}")
        if shares[-1] != 100:
            raise ValueError(f"the last step must be 100 percent (full promotion), got {shares[-1]}")
        return steps

    @field_validator("suite")
    @classmethod
    def _suite_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"gate suite {path} does not exist")
        return path

    def suite_path(self) -> Path:
        return DEFAULT_SUITE if self.suite is None else self.suite
