"""`tideflow audit`: list the home's audit log and check its chain (engine.control.audit)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("audit", help="list the controller's audit log; --verify checks its hash chain")
    p.add_argument("--file", type=Path, default=None,
                   help="the log to read (default: $TIDEFLOW_HOME/audit.jsonl; on Kubernetes, a copy of the "
                        "controller pod's, or its log lines starting 'audit ')")
    p.add_argument("--limit", type=int, default=20, help="entries listed, the newest last (0: all)")
    p.add_argument("--verify", action="store_true",
                   help="check every line against the chain: exit 1 naming each line that does not follow")
    p.add_argument("--json", action="store_true", help="entries (or the verification) as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from engine.control.audit import AUDIT_FILE, read_entries, verify
    from engine.runtime.paths import home

    path = args.file or home() / AUDIT_FILE
    if not path.is_file():
        print(f"tideflow audit: no audit log at {path} (a controller writes it once it serves a control call)",
              file=sys.stderr)
        return 2
    if args.verify:
        report = verify(path)
        if args.json:
            print(report.model_dump_json(indent=1))
        elif report.intact:
            print(f"chain intact: {report.entries} entries, head {report.head}")
        else:
            for b in report.breaks:
                print(f"line {b.line}: {b.why}")
            print(f"chain BROKEN at {len(report.breaks)} of {report.entries} lines; head {report.head}")
        return 0 if report.intact else 1
    entries = read_entries(path)
    shown = entries[-args.limit:] if args.limit > 0 else entries
    if args.json:
        print(json.dumps([e.model_dump() for e in shown], indent=1))
        return 0
    for e in shown:
        print(f"{e.seq:>6}  {e.at}  {e.actor:<24}  {e.action:<32}  {e.target or '-':<20}  {e.result} ({e.status})")
    return 0
