"""Canary gates: a Great Expectations suite (data: engine/canary/canary_suite.json, or the plan's) run on the judge table.

Each row is one metric of one step: the judge's verdict, its estimate and confidence bounds, the p-value and
the alpha it was tested at (engine/canary/judge.py). The suite is the declared gate: what must hold of those
rows for a step to pass. `step_row` builds the figures table (canary beside stable) shown to people.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field

from engine.canary.metrics import GroupFigures
from engine.runtime.errors import TideflowError

FIGURES = ("requests", "errors", "error_rate", "ttft_p99_s", "tpot_p99_s", "throughput_tps")


class GateSuiteError(TideflowError):
    """The gate suite file cannot be read or holds an expectation Great Expectations does not know."""


class GateResult(BaseModel):
    success: bool
    failed: list[str] = Field(default_factory=list, description="the failed expectations, with what was observed")
    validation: dict = Field(default_factory=dict, description="the full GX validation result (JSON-serialisable)")


def step_row(step: int, percent: float, canary: GroupFigures, baseline: GroupFigures, baseline_step: int) -> dict:
    """One row of the step table: canary_* and stable_* figures and the comparison columns (canary less
    stable in percentage points or milliseconds, canary over stable as a ratio)."""
    row: dict = {"step": step, "percent": percent, "baseline_step": baseline_step}
    for name in FIGURES:
        row[f"canary_{name}"] = getattr(canary, name)
        row[f"stable_{name}"] = getattr(baseline, name)
    c, s = canary.error_rate, baseline.error_rate
    row["error_rate_excess_pp"] = None if c is None else 100.0 * (c - (s or 0.0))
    for name in ("ttft_p99", "tpot_p99"):
        a, b = getattr(canary, f"{name}_s"), getattr(baseline, f"{name}_s")
        row[f"{name}_ratio"] = None if a is None or not b else a / b
        row[f"{name}_excess_ms"] = None if a is None or b is None else 1000.0 * (a - b)
    return row


class GateSuite:
    """The suite loaded once into an ephemeral GX context; `validate` is cheap enough to call every second."""

    def __init__(self, path: Path) -> None:
        import great_expectations as gx  # slow to import: only when a rollout starts
        from great_expectations.data_context.types.base import ProgressBarsConfig

        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise GateSuiteError(f"{path}: cannot read the gate suite: {exc}") from None
        context = gx.get_context(mode="ephemeral")
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        self._batches = (context.data_sources.add_pandas("canary").add_dataframe_asset("steps")
                         .add_batch_definition_whole_dataframe("all"))
        self.suite = context.suites.add(gx.ExpectationSuite(**data))
        # GX logs and skips an expectation it cannot build; a gate must never vanish silently.
        wanted = [e.get("type") for e in data.get("expectations", [])]
        built = [e.expectation_type for e in self.suite.expectations]
        if len(built) != len(wanted):
            missing = [t for t in wanted if t not in built]
            raise GateSuiteError(f"{path}: unknown or invalid expectations {missing}")
        self.name = self.suite.name

    def validate(self, rows: list[dict]) -> GateResult:
        import pandas as pd

        frame = pd.DataFrame(rows)
        numeric = [k for k in frame.columns if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                                   for v in frame[k])]
        frame = frame.astype({k: "float64" for k in numeric})  # None -> NaN, which the suite's not-null checks see
        result = self._batches.get_batch(batch_parameters={"dataframe": frame}).validate(self.suite)
        failed = [_describe(r) for r in result.results if not r.success]
        return GateResult(success=bool(result.success), failed=failed, validation=result.to_json_dict())


def _describe(r) -> str:
    kwargs = {k: v for k, v in r.expectation_config.kwargs.items() if k != "batch_id"}
    seen = (r.result or {}).get("partial_unexpected_list")
    return f"{r.expectation_config.type} {kwargs}" + (f": observed {seen}" if seen else "")
