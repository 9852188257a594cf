"""The `tideflow` command: one parser; each subsystem registers its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from engine.errors import TideflowError

# Modules exposing add_commands(subparsers), imported in this order.
COMMAND_MODULES = ("engine.cli", "engine.serve_cli", "engine.router.cli", "engine.control.cli", "engine.group.cli",
                   "engine.weights.cli", "kernels.cli", "engine.drills.cli", "flows.pipeline_cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideflow", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (TideflowError, ValueError, OSError) as exc:  # bad input or a refused call: one line, no traceback
        print(f"tideflow: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def one_line(exc: BaseException) -> str:
    """The message on one line (a pydantic error lists each field on lines of its own)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "errors.pydantic.dev" not in ln]
    return "; ".join(lines) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
