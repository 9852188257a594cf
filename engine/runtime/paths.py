"""Where tideflow keeps its state on this machine (`TIDEFLOW_HOME`, default ~/.tideflow)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """$TIDEFLOW_HOME, or ~/.tideflow when it is unset or empty (an empty value must not mean the current directory)."""
    return Path(os.environ.get("TIDEFLOW_HOME") or "~/.tideflow").expanduser()


def default_model_dir() -> Path:
    return home() / "models" / "default"
