"""Token-length laws of a drill's prompts and answers, parsed from short strings (`uniform:16:64`)."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError, model_validator


class LengthDistribution(BaseModel):
    """A token-length law parsed from `fixed:N`, `uniform:A:B`, `normal:MU:SIGMA[:MIN:MAX]`, `lognormal:MEDIAN:SIGMA[:MIN:MAX]`."""

    kind: Literal["fixed", "uniform", "normal", "lognormal"] = Field(description="the law")
    a: float = Field(gt=0, description="fixed: N; uniform: low; normal: mean; lognormal: median")
    b: float = Field(0.0, ge=0, description="uniform: high; normal and lognormal: sigma (lognormal's in log space)")
    min: int = Field(1, ge=1, description="samples are clipped to at least this")
    max: int | None = Field(None, ge=1, description="samples are clipped to at most this")

    @model_validator(mode="after")
    def _consistent(self) -> LengthDistribution:
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform:{self.a:g}:{self.b:g} needs low <= high")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max {self.max} is below min {self.min}")
        return self

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        parts = text.strip().split(":")
        if len(parts) == 1:
            parts = ["fixed", parts[0]]
        kind, nums = parts[0], parts[1:]
        arity = {"fixed": (1, 1), "uniform": (2, 2), "normal": (2, 4), "lognormal": (2, 4)}
        if kind not in arity or not arity[kind][0] <= len(nums) <= arity[kind][1] or len(nums) == 3:
            raise ValueError(f"bad length spec {text!r}: use fixed:N, uniform:A:B, normal:MU:SIGMA[:MIN:MAX] "
                             f"or lognormal:MEDIAN:SIGMA[:MIN:MAX]")
        try:
            values = [float(n) for n in nums]
            fields: dict = {"kind": kind, "a": values[0]}
            if len(values) > 1:
                fields["b"] = values[1]
            if len(values) == 4:
                fields["min"], fields["max"] = int(values[2]), int(values[3])
            return cls(**fields)
        except (ValueError, ValidationError) as e:
            raise ValueError(f"bad length spec {text!r}: {e}") from None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b), endpoint=True, size=n).astype(float)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        else:
            x = rng.lognormal(math.log(self.a), self.b, size=n)
        return np.clip(np.rint(x), self.min, self.max if self.max is not None else None).astype(int)

    def __str__(self) -> str:
        nums = [self.a] if self.kind == "fixed" else [self.a, self.b]
        if self.max is not None and self.kind in ("normal", "lognormal"):
            nums += [self.min, self.max]
        return ":".join([self.kind] + [f"{x:g}" for x in nums])
