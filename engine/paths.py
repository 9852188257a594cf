"""Where tideflow keeps its state on this machine (`TIDEFLOW_HOME`, default ~/.tideflow)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("TIDEFLOW_HOME", "~/.tideflow")).expanduser()


def default_model_dir() -> Path:
    return home() / "models" / "default"
