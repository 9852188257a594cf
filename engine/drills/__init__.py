"""Drills against a running OpenAI-compatible server: open-loop load (`run_load_drill`) with reports."""

from engine.drills.load import DrillProgress, run_load_drill, run_load_drill_async
from engine.drills.results import LoadDrillReport
from engine.drills.spec import LoadDrillSpec

__all__ = ["DrillProgress", "LoadDrillReport", "LoadDrillSpec", "run_load_drill", "run_load_drill_async"]
