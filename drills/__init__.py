"""Drills against a running OpenAI-compatible server: open-loop load (`run_load_drill`) with reports."""

from drills.load import DrillProgress, run_load_drill, run_load_drill_async
from drills.results import LoadDrillReport
from drills.spec import LoadDrillSpec

__all__ = ["DrillProgress", "LoadDrillReport", "LoadDrillSpec", "run_load_drill", "run_load_drill_async"]
