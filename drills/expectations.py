"""Great Expectations check of a drill's step table: the suite is data, packaged beside this module
(load_drill_suite.json) and loaded through importlib.resources, so an installed wheel finds it too."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drills.results import ExpectationOutcome, LoadDrillReport

DEFAULT_SUITE = Path(str(files("drills") / "load_drill_suite.json"))


def validate_steps(report: LoadDrillReport, suite_path: Path) -> ExpectationOutcome:
    """Validate the step table (plus the computed column `accounted` = ok + error) against the suite at `suite_path`."""
    import great_expectations as gx  # slow to import: only when a drill validates
    from great_expectations.data_context.types.base import ProgressBarsConfig

    from drills.results import ExpectationOutcome

    frame = report.step_frame()
    frame["accounted"] = frame["ok"] + frame["error"]
    suite_data = json.loads(Path(suite_path).read_text())
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (context.data_sources.add_pandas("load_drill").add_dataframe_asset("steps")
             .add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": frame}))
    suite = context.suites.add(gx.ExpectationSuite(**suite_data))
    result = batch.validate(suite)
    failed = [f"{r.expectation_config.type} {r.expectation_config.kwargs}" for r in result.results if not r.success]
    return ExpectationOutcome(suite=suite.name, success=bool(result.success), failed=failed)
