"""What the HTTP path costs: the engine alone against `tideflow serve` three ways, on the same prompts and streams.

    python benchmarks/http_overhead.py [--streams 32 128] [--prompt-len 128] [--output-len 128]
                                       [--dtype float32] [--device cpu] [--modes thread process process2]

The engine alone: every prompt an `LLMEngine.stream` consumer on one event loop in this process (the engine's
own throughput, benchmarks/serving.py's figure). Then `tideflow serve` started as a user starts it, the streams
sent by the official openai client over HTTP with SSE:
  thread    the engine on a thread of the API server's process (`--engine-core thread`, the default);
  process   the engine core in a process of its own (`--engine-core process`);
  process2  the same with two API server processes (`--api-server-count 2`).
Each row prints output tokens/s and what share of the engine's own throughput the HTTP path keeps. On a small
host the openai client shares the cores with the server, as any load generator on the same machine does.
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
from common import print_table  # noqa: E402
from peer_vllm import prompts, start_tideflow, streams  # noqa: E402
from serving import engine_throughput  # noqa: E402

from engine.runtime import intraop  # noqa: E402
from engine.core.engine_config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.runtime.device import resolve_device  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402
from tideflow_kernels.startup import arch_for, startup_ops  # noqa: E402

MODES = {"thread": ["--engine-core", "thread"], "process": ["--engine-core", "process"],
         "process2": ["--engine-core", "process", "--api-server-count", "2"]}


def engine_alone(model_dir: Path, runs: dict[int, list[list[str]]], args, max_seqs: int) -> dict[int, float]:
    """Output tok/s of the engine in this process, per stream count (the median of the runs)."""
    intraop.serial_process()  # as `serve` does: the engine thread alone runs parallel ops
    startup_ops(arch_for(resolve_device(args.device)), "auto")
    tokenizer = Tokenizer(model_dir)
    config = EngineConfig(dtype=args.dtype, device=args.device, kv_cache_bytes=1 << 30, max_num_seqs=max_seqs)
    engine = LLMEngine(load_model(model_dir, args.dtype, args.device), tokenizer, config)
    engine.start()
    try:
        engine_throughput(engine, [tokenizer.encode(t) for t in runs[args.streams[0]][0][:4]], 8)  # warm-up
        return {n: statistics.median(engine_throughput(engine, [tokenizer.encode(t) for t in texts], args.output_len)
                                     for texts in runs[n]) for n in args.streams}
    finally:
        engine.stop()


def served(mode: str, model_dir: Path, runs: dict[int, list[list[str]]], args, max_seqs: int,
           log_dir: Path) -> dict[int, float]:
    flags = [*MODES[mode], "--max-num-seqs", str(max_seqs), "--device", args.device]
    child, url = start_tideflow(model_dir, args.dtype, log_dir, "tideflow", flags)
    try:
        asyncio.run(streams(url, runs[args.streams[0]][0][:4], 8))  # warm-up
        return {n: statistics.median(asyncio.run(streams(url, texts, args.output_len))[0] for texts in runs[n])
                for n in args.streams}
    finally:
        child.stop(grace_s=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--repeats", type=int, default=3, help="runs per stream count; the median is reported")
    args = ap.parse_args()
    max_seqs = max(args.streams)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        runs = {n: [prompts(model_dir, 1000 * n + r, n, args.prompt_len) for r in range(args.repeats)]
                for n in args.streams}
        results = {mode: served(mode, model_dir, runs, args, max_seqs, Path(tmp)) for mode in args.modes}
        alone = engine_alone(model_dir, runs, args, max_seqs)
    rows = [["engine alone (no HTTP)", *(f"{alone[n]:.0f}" for n in args.streams), *("1.00" for _ in args.streams)]]
    for mode in args.modes:
        rows.append([f"serve {' '.join(MODES[mode])}", *(f"{results[mode][n]:.0f}" for n in args.streams),
                     *(f"{results[mode][n] / alone[n]:.2f}" for n in args.streams)])
    print(f"\ndefault model, {args.dtype}, {args.device}, {os.cpu_count()} cores, {args.prompt_len} in / "
          f"{args.output_len} out, greedy; kept = HTTP path tok/s / engine-alone tok/s")
    print_table(["path", *(f"{n} streams tok/s" for n in args.streams), *(f"{n} streams kept" for n in args.streams)],
                rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
