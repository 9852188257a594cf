"""Decode on a GPU, eager against CUDA graphs in one run: the engine alone (no HTTP) at several stream counts, and
one 32-stream decode step under torch.profiler (how much of its wall time the device is busy, kernel launches and
host syncs per step).

    python benchmarks/gpu_decode.py [--streams 1 32 128 256] [--prompt 64] [--new-tokens 64] [--dtype bfloat16]

Each mode is a fresh engine (`enforce_eager` on and off) over the same weights and compiled ops, given the same
prompts; the greedy tokens of both are compared (they must be the same). Targets (issue #40, H200 class, bf16,
the default model): batch 1 >= 1,000 tok/s, 32 streams >= 15,000, 256 streams >= 40,000 and never below 128,
device busy >= 80 % of a 32-stream step, graphs >= 3x eager at batch 1. Needs a CUDA device; exits 2 without.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.core.engine_config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402
from tideflow_kernels.startup import arch_for, startup_ops  # noqa: E402


def engine_for(model, tokenizer, dtype: str, eager: bool, max_seqs: int) -> LLMEngine:
    config = EngineConfig(device="cuda", dtype=dtype, enforce_eager=eager, max_num_seqs=max_seqs, max_wait_ms=0,
                          max_batch_tokens=max(2048, 64 * max_seqs), kv_cache_fraction=0.3, max_client_tokens=0)
    engine = LLMEngine(model, tokenizer, config)
    engine.start()
    engine.warm_up()  # captures the graphs where they are on
    graphs = engine.runner.graphs
    if not eager and (graphs is None or not graphs.graphs):
        raise SystemExit("gpu_decode: no CUDA graph was captured (the engine log says why): nothing to compare")
    return engine


def throughput(engine: LLMEngine, streams: int, prompt: int, new: int) -> tuple[float, list[list[int]]]:
    prompts = [[(7 * s + 3 * i) % 1000 + 5 for i in range(prompt)] for s in range(streams)]
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    took = time.perf_counter() - t0
    return streams * new / took, [r.token_ids for r in results]


def step_profile(engine: LLMEngine, streams: int, steps: int = 20) -> tuple[float, float, float]:
    """Device-busy share, kernel launches and host syncs per decode step, over `steps` steps of `streams` streams
    (the prompts prefilled before the profile starts)."""
    prompts = [[(11 * s + i) % 1000 + 5 for i in range(32)] for s in range(streams)]
    done = []

    def sink(out) -> None:
        if out.finished:
            done.append(out.request_id)

    for p in prompts:
        engine.submit(p, SamplingParams(max_tokens=steps + 40, ignore_eos=True), sink)
    while engine.num_running < streams or engine.num_queued:  # every prompt prefilled: decode steps only from here
        time.sleep(0.001)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        seen = engine.metrics.value("tideflow_generation_tokens_total")
        while engine.metrics.value("tideflow_generation_tokens_total") - seen < steps * streams:
            time.sleep(0.0005)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    device_us = sum(e.device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch",
                                                      "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    syncs = sum(1 for e in events if "Synchronize" in e.name or e.name == "cudaMemcpy")
    while len(done) < streams:  # the rest of the answers, so the engine is idle for the next run
        time.sleep(0.01)
    return device_us / 1e6 / wall, launches / steps, syncs / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    startup_ops(arch_for(device))
    with tempfile.TemporaryDirectory(prefix="tideflow-gpu-decode-") as tmp:
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        model, tokenizer = load_model(model_dir, args.dtype, "cuda"), Tokenizer(model_dir)
        rows, tokens, profiles = {}, {}, {}
        for mode, eager in (("eager", True), ("graphs", False)):
            engine = engine_for(model, tokenizer, args.dtype, eager, max(args.streams))
            try:
                for streams in args.streams:
                    rate, tokens[(mode, streams)] = throughput(engine, streams, args.prompt, args.new_tokens)
                    rows.setdefault(streams, {})[mode] = rate
                    print(f"{mode} {streams} streams: {rate:,.0f} tok/s", file=sys.stderr, flush=True)
                profiles[mode] = step_profile(engine, min(32, max(args.streams)))
            finally:
                engine.stop()
                del engine
                gc.collect()  # the engine's KV cache is held through reference cycles: free it for the next mode
                torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"{args.dtype}; default model; {args.prompt} tokens in, {args.new_tokens} out")
    print_table(["streams", "eager tok/s", "graphs tok/s", "graphs / eager", "same tokens"],
                [[s, f"{r['eager']:,.0f}", f"{r['graphs']:,.0f}", f"{r['graphs'] / r['eager']:.2f}x",
                  "yes" if tokens[("eager", s)] == tokens[("graphs", s)] else "NO"] for s, r in rows.items()])
    print_table([f"{min(32, max(args.streams))}-stream decode step", "device busy", "launches / step",
                 "host syncs / step"],
                [[mode, f"{100 * busy:.1f} %", f"{launches:.0f}", f"{syncs:.1f}"]
                 for mode, (busy, launches, syncs) in profiles.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
