"""What tracing costs: the same PD fleet (router -> prefill -> decode, separate processes) with tracing on (the
default: spans to the JSON-lines files in $TIDEFLOW_HOME/traces) and off (OTEL_SDK_DISABLED=true), the same
streams through the official openai client, runs alternating on/off so drift of the machine hits both alike.

    python benchmarks/tracing_overhead.py [--streams 32] [--prompt-len 64] [--output-len 64] [--repeats 3] [--rounds 3]

Prints output tokens/s and TTFT p50 per fleet (the median of its rounds), the medians, and the ratio on/off (the target: tracing costs
under 2 % of throughput). Every traced request writes about a dozen spans across the three processes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, pd_group_up, print_table, run_streams  # noqa: E402

from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
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
        asyncio.run(run_streams(gs.url, gs.client_key, 4, args.prompt_len, 8, seed + 1))  # warm-up
        runs = [asyncio.run(run_streams(gs.url, gs.client_key, args.streams, args.prompt_len, args.output_len,
                                        seed * 100 + i)) for i in range(args.rounds)]
    spans = len(read_spans(home / "traces")) if (home / "traces").is_dir() else 0
    return statistics.median(r for r, _ in runs), statistics.median(t for _, t in runs), spans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="words per prompt")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="fleets per mode, alternating on and off")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs of the streams per fleet (their median)")
    args = ap.parse_args()
    rows, figures = [], {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        for r in range(args.repeats):
            for traced in ((True, False) if r % 2 == 0 else (False, True)):
                rate, ttft, spans = fleet_run(model_dir, Path(tmp) / f"home-{r}-{traced}", traced, args, seed=r)
                figures[traced].append((rate, ttft))
                rows.append([r, "on" if traced else "off", f"{rate:.0f}", f"{ttft:.0f}", spans])
                print(f"run {r} tracing {'on' if traced else 'off'}: {rate:.0f} tok/s, TTFT p50 {ttft:.0f} ms, "
                      f"{spans} spans", flush=True)
    print(f"\n{host()}; default model, float32, PD group (1 prefill + 1 decode) behind the router, {args.streams} "
          f"streams, {args.prompt_len} words in / {args.output_len} tokens out, greedy")
    print_table(["run", "tracing", "tok/s", "TTFT p50 ms", "spans written"], rows)
    on_rate, off_rate = (statistics.median(r for r, _ in figures[m]) for m in (True, False))
    on_ttft, off_ttft = (statistics.median(t for _, t in figures[m]) for m in (True, False))
    print(f"\nmedians: on {on_rate:.0f} tok/s, off {off_rate:.0f} tok/s: throughput on/off {on_rate / off_rate:.3f} "
          f"(cost {100 * (1 - on_rate / off_rate):+.1f} %); TTFT p50 on/off {on_ttft / off_ttft:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
