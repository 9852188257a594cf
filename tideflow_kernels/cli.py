"""`tideflow kernels build`: compile, verify and time the custom ops, cached by source hash."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from tideflow_kernels.errors import BuildFailed
from tideflow_kernels.report import table
from tideflow_kernels.spec import OP_NAMES, BuildRequest


def _build(args: argparse.Namespace) -> int:
    from tideflow_kernels.build import build  # torch and the compiler: not for the other commands' start

    try:
        request = BuildRequest(target=args.target, arch=args.arch, opt_level=args.opt_level,
                               source_dir=args.source_dir, bench_iters=args.bench_iters,
                               bench_hidden=args.bench_hidden)
    except ValidationError as exc:
        print(f"kernels build: {exc}", file=sys.stderr)
        return 2
    try:
        manifest = build(request, progress=lambda msg: print(f"kernels: {msg}", file=sys.stderr))
    except BuildFailed as exc:
        print(table(exc.manifest))
        print(str(exc), file=sys.stderr)
        print("the engine keeps using the torch reference for these ops", file=sys.stderr)
        return 1
    print(table(manifest))
    return 0


def add_commands(subparsers) -> None:
    """Register `kernels build` on the top-level parser's subparsers."""
    kernels = subparsers.add_parser("kernels", help="custom ops: build, verify, benchmark")
    sub = kernels.add_subparsers(dest="kernels_command", required=True)
    b = sub.add_parser("build", help="compile + check against the reference + time; cached")
    b.add_argument("--target", default="all", help=f"all or one of: {', '.join(OP_NAMES)}")
    b.add_argument("--arch", default="native", help="native | cpu | x86-64-vN | sm_80 | sm_90 | ...")
    b.add_argument("--opt-level", type=int, default=3, choices=range(4), metavar="0-3")
    b.add_argument("--source-dir", default=None, help="build these sources instead of tideflow_kernels/csrc")
    b.add_argument("--bench-iters", type=int, default=20, help="timed calls per op and side")
    b.add_argument("--bench-hidden", type=int, default=4096, help="hidden size of the timing call")
    b.set_defaults(func=_build)
