"""`python -m engine.main ...`: the engine's own commands, one parser; each subsystem registers its subcommands.

This is how the engine starts its processes (members, routers, controllers: engine.runtime.process.tideflow_argv)
without reaching up into the Prefect layer. The `tideflow` command (flows/cli.py) is these commands plus the
pipeline's (`release`, `ui`), which live above the engine.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from engine.runtime.errors import TideflowError
from tideflow_kernels import isa

# Modules exposing add_commands(subparsers), imported in this order.
ENGINE_COMMANDS = ("engine.offline.cli", "engine.server.cli", "engine.router.cli", "engine.control.cli", "engine.control.group_cli",
                   "engine.control.audit_cli", "engine.control.keys_cli", "engine.weights.cli", "tideflow_kernels.cli", "engine.capacity.cli",
                   "engine.telemetry.trace_cli")


def build_parser(modules: tuple[str, ...] = ENGINE_COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tideflow", description="tideflow: workflow-orchestrated deployment "
                                                                  "pipelines for disaggregated MoE LLM inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in modules:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None, modules: tuple[str, ...] = ENGINE_COMMANDS) -> int:
    try:
        isa.cap_libraries()  # $TIDEFLOW_NO_AMX: before anything computes (oneDNN reads its cap once); children inherit it
    except ValueError as exc:
        print(f"tideflow: error: {one_line(exc)}", file=sys.stderr)
        return 2
    args = build_parser(modules).parse_args(argv)
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
