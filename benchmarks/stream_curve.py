"""Engine throughput as concurrent streams grow (1 to 256 by default): where the curve bends and why.

    python benchmarks/stream_curve.py [--streams 1 32 64 128 256] [--prompt-len 64] [--gen 64] [--dtype float32]
                                      [--device cpu] [--max-num-seqs 0]

No HTTP: every stream is an `LLMEngine.stream` consumer on one event loop, as benchmarks/serving.py measures
the engine alone. Per stream count it prints output tokens/s, tokens/s per stream, model steps, mean running
batch, the mean wall time of a step and of its model call, and preemptions: a curve that falls while the batch
stays capped points at `--max-num-seqs` (0: as many as the streams) or at the KV budget, one whose step time
grows faster than its batch at the host.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402
from serving import engine_throughput  # noqa: E402

from engine.core.engine_config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402
from tideflow_kernels.startup import arch_for, startup_ops  # noqa: E402


class StepLog:
    """What the engine loop did during one run: steps, their batch sizes, wall and model time, preemptions."""

    def __init__(self, engine: LLMEngine, device: torch.device) -> None:
        self.steps = self.batch = self.preempted = 0
        self.step_s = self.model_s = 0.0
        schedule, step, run = engine.scheduler.schedule, engine.runner.step, engine._run

        def timed_schedule(now):
            plan = schedule(now)
            self.preempted += plan.preempted
            return plan

        def timed_step(seqs):
            t0 = time.perf_counter()
            logits = step(seqs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.model_s += time.perf_counter() - t0
            return logits

        def timed_run(plan):
            t0 = time.perf_counter()
            run(plan)
            self.steps += 1
            self.batch += len(plan.batch)
            self.step_s += time.perf_counter() - t0

        engine.scheduler.schedule, engine.runner.step, engine._run = timed_schedule, timed_step, timed_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32, 64, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="running batch cap; 0: as many as the streams")
    args = ap.parse_args()
    device = torch.device(args.device)
    compiled = startup_ops(arch_for(device), "auto")
    print(f"ops: {', '.join(sorted(compiled)) or 'torch reference'} compiled; {args.dtype} on {args.device}, "
          f"{torch.get_num_threads()} threads; {args.prompt_len} tokens in, {args.gen} out")
    rng = random.Random(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_default_model(tmp, DEFAULT_CONFIG, seed=0))
        model, tokenizer = load_model(model_dir, args.dtype, args.device), Tokenizer(model_dir)
        vocab = model.config.vocab_size
        for streams in args.streams:
            cap = args.max_num_seqs or streams
            config = EngineConfig(kv_cache_bytes=1 << 30, max_num_seqs=cap, max_queue=max(streams, 1),
                                  max_batch_tokens=4096, max_wait_ms=0, dtype=args.dtype, device=args.device)
            engine = LLMEngine(model, tokenizer, config)
            engine.start()
            engine.warm_up()
            log = StepLog(engine, device)
            prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(streams)]
            tok_s = engine_throughput(engine, prompts, args.gen)
            engine.stop()
            rows.append([streams, cap, round(tok_s, 1), round(tok_s / streams, 1), log.steps,
                         round(log.batch / max(log.steps, 1), 1), round(1e3 * log.step_s / max(log.steps, 1), 2),
                         round(1e3 * log.model_s / max(log.steps, 1), 2), log.preempted])
            print(f"  {streams} streams: {tok_s:.1f} tok/s", flush=True)
    print()
    print_table(["streams", "max_num_seqs", "tok/s", "tok/s per stream", "steps", "mean batch", "step ms",
                 "model ms", "preempted"], rows)


if __name__ == "__main__":
    main()
