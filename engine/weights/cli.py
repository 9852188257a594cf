"""`tideflow weights publish|verify|pull`: one-line results, one-line errors, non-zero on failure."""

import argparse
import sys

from engine.runtime.argtypes import positive_int
from engine.weights.config import MiB
from engine.weights.errors import WeightsError
from engine.weights.publish import publish
from engine.weights.pull import pull
from engine.weights.verify import verify


def _run(action) -> int:
    try:
        print(action())
    except WeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    return 0


def _publish(args: argparse.Namespace) -> int:
    def action() -> str:
        r = publish(
            args.dir, args.to, force=args.force,
            part_size=args.part_size * MiB if args.part_size else None,
            max_concurrency=args.concurrency, show_progress=True,
        )
        state = "published" if r.manifest_written else "already published (identical)"
        return (f"{state}: {r.url} ({len(r.manifest.files)} files, {r.parts_uploaded} parts sent, "
                f"{r.parts_reused} resumed, {r.files_unchanged} unchanged)")
    return _run(action)


def _verify(args: argparse.Namespace) -> int:
    def action() -> str:
        r = verify(args.url, deep=args.deep, max_concurrency=args.concurrency, show_progress=True)
        return f"verified{' (deep)' if r.deep else ''}: {r.url} ({r.files_checked} files)"
    return _run(action)


def _pull(args: argparse.Namespace) -> int:
    def action() -> str:
        r = pull(args.url, args.cache, max_concurrency=args.concurrency, show_progress=True)
        if r.noop:
            return f"cache already verified: {r.cache_dir}"
        return f"pulled {r.url} -> {r.cache_dir} ({r.files_fetched} fetched, {r.files_kept} kept)"
    return _run(action)


def add_commands(subparsers) -> None:
    """Register `weights` and its subcommands."""
    weights = subparsers.add_parser("weights", help="publish, verify and pull model weights")
    sub = weights.add_subparsers(dest="weights_command", required=True)

    p = sub.add_parser("publish", help="upload a checkpoint directory as a version")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--to", required=True, help="s3://bucket/models/<name>/<version>/, file:///path/ or a path")
    p.add_argument("--force", action="store_true", help="overwrite a version that holds other content")
    p.add_argument("--part-size", type=positive_int, help="part size in MiB (default 64, at least 5)")
    p.add_argument("--concurrency", type=positive_int, help="parts in flight (default 8)")
    p.set_defaults(func=_publish)

    v = sub.add_parser("verify", help="check a published version against its manifest")
    v.add_argument("url", help="the version's URL")
    v.add_argument("--deep", action="store_true", help="stream every byte and recompute SHA-256")
    v.add_argument("--concurrency", type=positive_int, help="ranged GETs in flight (deep mode)")
    v.set_defaults(func=_verify)

    g = sub.add_parser("pull", help="fetch a version into a node-local cache")
    g.add_argument("url", help="the version's URL")
    g.add_argument("--cache", required=True, help="cache directory")
    g.add_argument("--concurrency", type=positive_int, help="ranged GETs in flight")
    g.set_defaults(func=_pull)
