"""Where one engine step's time goes, at batch 1 and at 32 streams: the engine thread's phases (scheduling,
step inputs, the model, sampling, detokenisation and stop checks) timed in place, and the model's time split
by op (attention, MoE, matmuls, the rest) from torch.profiler.

    python benchmarks/profile_engine.py [--batches 1 32] [--new-tokens 64] [--dtype float32]

The phases are wall time on the engine thread (they add up to the run); op times are torch.profiler's
self CPU time on that thread. No HTTP: the serving stack's share is the gap between this and
benchmarks/serving.py at the same load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

import engine.core.llm_engine as llm_engine  # noqa: E402
from engine.runtime import intraop  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.core.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402
from tideflow_kernels.startup import startup_ops  # noqa: E402

CATEGORIES = [  # first match wins, on the lower-cased op name
    ("attention", ("attention", "sdpa", "softmax_backward")),
    ("moe", ("moe", "gating", "topk", "index_add", "scatter", "gather", "sort")),
    ("matmul", ("linear", "addmm", "mm", "matmul", "bmm")),
    ("norm + rotary", ("norm", "rotary")),
    ("sampling", ("argmax", "multinomial", "softmax", "isfinite")),
]


def category(op: str) -> str:
    name = op.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other ops")


class Phases:
    """Wall time of the engine thread's phases, by wrapping the functions that make them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._wrap(engine.scheduler, "schedule", "scheduling")
        self._wrap(engine, "_step", "step inputs (tokens, block tables)")
        self._wrap(engine.runner, "step", "model forward")
        self._wrap(llm_engine, "sample", "sampling")
        self._wrap(engine, "_on_token", "detokenise + stop checks + emit")
        self._wrap(engine, "_observe", "metrics")

    def _wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[label] += time.perf_counter() - t0

        setattr(owner, name, timed)


def run(model, tok, batch: int, prompt_len: int, new_tokens: int, kv_bytes: int) -> tuple[dict, dict, float, int]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    config = EngineConfig(kv_cache_bytes=kv_bytes, max_num_seqs=max(batch, 1), max_wait_ms=0)
    warm = LLMEngine(model, tok, config)  # warms the process (allocator, kernels) outside the measured engine
    warm.start()
    warm.generate(prompts, params)
    warm.stop()
    engine = LLMEngine(model, tok, config)
    phases = Phases(engine)
    traces: list = []
    loop = engine._loop

    def profiled_loop() -> None:  # torch.profiler records the ops of the thread it runs in: the engine thread
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loop()
        traces.append(prof)

    engine._loop = profiled_loop
    engine.start()
    try:
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        engine.stop()
    ops: dict[str, float] = defaultdict(float)
    for e in traces[0].key_averages():
        if "::" in e.key:
            ops[e.key] += e.self_cpu_time_total / 1e6
    return dict(phases.totals), dict(ops), wall, sum(len(r.token_ids) for r in results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--kernels", choices=["auto", "cached", "reference"], default="auto")
    ap.add_argument("--top", type=int, default=0, help="also list the N ops with the most self CPU time")
    args = ap.parse_args()
    intraop.serial_process()  # as `serve` runs: the engine thread alone runs parallel ops
    compiled = startup_ops("native", args.kernels)
    print(f"compiled ops: {', '.join(sorted(compiled)) or 'none (torch reference)'}; "
          f"{intraop.serial_process()} threads on the engine thread; {args.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        model, tok = load_model(model_dir, args.dtype), Tokenizer(model_dir)
        for batch in args.batches:
            phases, ops, wall, tokens = run(model, tok, batch, args.prompt_len, args.new_tokens, 256 << 20)
            print(f"\nbatch {batch}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s "
                  f"(prefill of {batch} x {args.prompt_len} tokens included)")
            other = wall - sum(phases.values())
            rows = [[k, v * 1000, 100 * v / wall] for k, v in sorted(phases.items(), key=lambda kv: -kv[1])]
            rows.append(["loop, queues, waits (the rest)", other * 1000, 100 * other / wall])
            print_table(["engine thread phase", "ms", "% of wall"], rows)
            forward = phases.get("model forward", 0.0)
            by_category: dict[str, float] = defaultdict(float)
            for op, t in ops.items():
                by_category[category(op)] += t
            op_rows = [[k, v * 1000, 100 * v / forward if forward else 0.0]
                       for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])]
            print_table(["op category (self CPU)", "ms", "% of model forward"], op_rows)
            if args.top:
                top = sorted(ops.items(), key=lambda kv: -kv[1])[: args.top]
                print_table(["op", "category", "ms"], [[k, category(k), v * 1000] for k, v in top])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
