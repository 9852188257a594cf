"""What tracing costs: the same PD fleet (router -> prefill -> decode, separate processes) with tracing on (the
default: spans to the JSON-lines files in $TIDEFLOW_HOME/traces) and off (OTEL_SDK_DISABLED=true), the same
streams through the official openai client, runs alternating on/off so drift of the machine hits both alike.

    python benchmarks/tracing_overhead.py [--streams 32] [--prompt-len 64] [--output-len 64] [--repeats 3] [--rounds 3]

Prints output tokens/s and TTFT p50 per fleet (the median of its rounds), the medians, and the ratio on/off (the target: tracing costs
under 2 % of throughput). Every traced request writes about a dozen spans across the three processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compare_on_off, on_off_flags, pd_group_up, stream_rounds  # noqa: E402

from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.telemetry.trace_cli import read_spans  # noqa: E402


def fleet_run(model_dir: Path, home: Path, traced: bool, args, seed: int) -> tuple[float, float, int]:
    """(tok/s, TTFT p50 ms: the medians of its rounds; spans written) of one fleet started with tracing on or off."""
    os.environ["TIDEFLOW_HOME"] = str(home)
    if traced:
        os.environ.pop("OTEL_SDK_DISABLED", None)
    else:
        os.environ["OTEL_SDK_DISABLED"] = "true"
    with LocalGroupSet(GroupSetConfig(model_dir=model_dir)) as gs:
        pd_group_up(gs, model_dir, {"kv_cache_bytes": 256 << 20, "max_num_seqs": args.streams})
        rate, ttft = stream_rounds(gs, args, seed)
    spans = len(read_spans(home / "traces")) if (home / "traces").is_dir() else 0
    return rate, ttft, spans


def main() -> int:
    compare_on_off("tracing", on_off_flags(__doc__), fleet_run,
                   "PD group (1 prefill + 1 decode) behind the router", extra_headers=("spans written",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
