"""The `tideflow` command: the engine's commands (engine.main) and, above them, the pipeline's (`release`, `ui`)."""

from __future__ import annotations

import argparse
import sys

from engine import main as engine_main

# `tideflow drill` sits above the engine (drills/ drives a running fleet), so the engine's own command does not
# register it: this one does.
COMMAND_MODULES = (*engine_main.ENGINE_COMMANDS, "drills.cli", "flows.pipeline_cli")


def build_parser() -> argparse.ArgumentParser:
    return engine_main.build_parser(COMMAND_MODULES)


def main(argv: list[str] | None = None) -> int:
    return engine_main.main(argv, COMMAND_MODULES)


if __name__ == "__main__":
    sys.exit(main())
