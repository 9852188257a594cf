"""`tideflow trace <request-id | trace-id>`: one request's timeline across processes, from the file exporter's spans
($TIDEFLOW_HOME/traces/*.jsonl, engine/telemetry/tracing.py). Spans reach the files within a second or so of their
end (the batch processor's delay, OTEL_BSP_SCHEDULE_DELAY); with an OTLP collector, read traces there instead."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from engine.telemetry.tracing import REQUEST_ID, traces_dir

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")


def read_spans(folder: Path) -> list[dict]:
    """Every span in the folder's files; a line cut short by a process killed mid-write is skipped."""
    spans = []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                try:
                    span = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(span, dict) and "trace_id" in span:
                    spans.append(span)
    return spans


def find_trace(spans: list[dict], wanted: str) -> str | None:
    """The trace id `wanted` names: itself when it is one, else the trace of the span that carries it as request id
    (the latest, should two requests share an id)."""
    if TRACE_ID.match(wanted) and any(s["trace_id"] == wanted for s in spans):
        return wanted
    named = [s for s in spans if s.get("attributes", {}).get(REQUEST_ID) == wanted]
    return max(named, key=lambda s: s["start_ns"])["trace_id"] if named else None


def timeline(spans: list[dict], trace_id: str) -> list[tuple[int, dict]]:
    """The trace's spans as (depth, span), each parent before its children, siblings by start time. A span whose
    parent is not in the files (the client's own, or one not flushed yet) starts at depth 0."""
    mine = sorted((s for s in spans if s["trace_id"] == trace_id), key=lambda s: s["start_ns"])
    ids = {s["span_id"] for s in mine}
    children: dict[str | None, list[dict]] = {}
    for span in mine:
        parent = span["parent_id"] if span["parent_id"] in ids else None
        children.setdefault(parent, []).append(span)
    out: list[tuple[int, dict]] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in children.get(parent, []):
            out.append((depth, span))
            walk(span["span_id"], depth + 1)

    walk(None, 0)
    return out


def render(trace_id: str, rows: list[tuple[int, dict]]) -> str:
    t0 = min(span["start_ns"] for _, span in rows)
    t1 = max(span["end_ns"] for _, span in rows)
    named = sorted({span["attributes"][REQUEST_ID] for _, span in rows if REQUEST_ID in span.get("attributes", {})})
    lines = [f"trace {trace_id}" + (f" (request {', '.join(named)})" if named else "")
             + f": {len(rows)} spans, {(t1 - t0) / 1e6:.1f} ms"]
    lines.append(f"{'start ms':>10} {'took ms':>9}  {'process':<10} span")
    for depth, span in rows:
        mark = " !" if span.get("status") == "error" else ""
        lines.append(f"{(span['start_ns'] - t0) / 1e6:>+10.1f} {(span['end_ns'] - span['start_ns']) / 1e6:>9.1f}  "
                     f"{span.get('service', ''):<10} {'  ' * depth}{span['name']}{mark}")
        for link in span.get("links", []):
            lines.append(f"{'':>22}{'  ' * depth}  links to span {link['span_id']} of trace {link['trace_id']}")
    return "\n".join(lines)


def _trace(args: argparse.Namespace) -> int:
    folder = Path(args.dir) if args.dir else traces_dir()
    spans = read_spans(folder) if folder.is_dir() else []
    trace_id = find_trace(spans, args.id)
    if trace_id is None:
        print(f"tideflow trace: no span in {folder} names {args.id!r} (a request id such as cmpl-..., or a "
              "32-hex trace id); spans reach the files about a second after they end", file=sys.stderr)
        return 1
    rows = timeline(spans, trace_id)
    if args.json:
        print(json.dumps([span for _, span in rows], indent=1))
    else:
        print(render(trace_id, rows))
    return 0


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("trace", help="one request's timeline across router, prefill and decode",
                              description="Prints the spans of one request's trace from the file exporter, in a "
                                          "tree with each span's start (from the first) and duration.")
    p.add_argument("id", help="the request id its client saw (cmpl-..., chatcmpl-...) or a 32-hex trace id")
    p.add_argument("--dir", default=None, help="folder of *.jsonl span files (default: $TIDEFLOW_HOME/traces)")
    p.add_argument("--json", action="store_true", help="the spans as JSON, in timeline order")
    p.set_defaults(func=_trace)
