"""Serving benchmark: (a) engine vs transformers generate() throughput and batch-1 decode vs the
memory roofline; (b) the shuttle window vs window 0 under bursty Poisson load.

    python benchmarks/serving.py            # ~5 minutes on 2 CPU cores
    python benchmarks/serving.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time

import torch

from engine.offline.default_model import DEFAULT_CONFIG, write_default_model
from engine.core.llm_engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import Tokenizer
from tideflow_kernels.startup import arch_for, startup_ops


def copy_bandwidth(device: str, nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s moved (read + write) by a large tensor copy: the memory roofline's denominator."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * nbytes / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine_throughput(engine: LLMEngine, batch: list[list[int]], gen: int) -> float:
    """Generated tokens/s with every prompt as its own concurrent stream."""
    params = SamplingParams(max_tokens=gen, ignore_eos=True)

    async def consume(p: list[int]) -> int:
        return sum([len(out.token_ids) async for out in engine.stream(p, params)])

    async def run() -> int:
        return sum(await asyncio.gather(*(consume(p) for p in batch)))

    t0 = time.perf_counter()
    tokens = asyncio.run(run())
    return tokens / (time.perf_counter() - t0)


def hf_throughput(model_dir: str, batch: list[list[int]], gen: int, dtype: torch.dtype, device: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(batch, device=device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        model.generate(ids[:2, :8], attention_mask=mask[:2, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen,
                             do_sample=False, pad_token_id=0)
        _sync(device)
        elapsed = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


def batch1_decode(engine: LLMEngine, prompt: list[int], gen: int) -> float:
    """Decode tokens/s of one sequence (the prefill step excluded)."""
    stamps: list[float] = []
    done = threading.Event()

    def sink(out):
        stamps.append(time.perf_counter())
        if out.finished:
            done.set()

    engine.submit(prompt, SamplingParams(max_tokens=gen, ignore_eos=True), sink)
    done.wait(600)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def bursty_arrivals(rate: float, count: int, mean_burst: float, seed: int) -> list[float]:
    """Poisson process of bursts (geometric sizes), `rate` requests/s on average."""
    rng = random.Random(seed)
    times, t = [], 0.0
    while len(times) < count:
        t += rng.expovariate(rate / mean_burst)
        size = 1
        while rng.random() > 1 / mean_burst:
            size += 1
        times += [t] * size
    return times[:count]


def run_load(engine: LLMEngine, arrivals: list[float], batch: list[list[int]], gen: int) -> dict[str, float]:
    """Replay the arrival schedule; TTFT from submission, throughput over the whole run."""
    params = SamplingParams(max_tokens=gen, ignore_eos=True)
    first: dict[int, float] = {}
    submitted: dict[int, float] = {}
    left = threading.Semaphore(0)
    tokens = [0]

    def sink_for(i: int):
        def sink(out):
            now = time.perf_counter()
            first.setdefault(i, now)
            tokens[0] += len(out.token_ids)
            if out.finished:
                left.release()
        return sink

    t0 = time.perf_counter()
    for i, (at, p) in enumerate(zip(arrivals, batch)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submitted[i] = time.perf_counter()
        engine.submit(p, params, sink_for(i))
    for _ in arrivals:
        left.acquire(timeout=600)
    elapsed = time.perf_counter() - t0
    ttft = sorted(first[i] - submitted[i] for i in submitted)
    return {"ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "tok_s": tokens[0] / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--load-requests", type=int, default=40)
    ap.add_argument("--load-prompt-len", type=int, default=128)
    ap.add_argument("--load-gen", type=int, default=24)
    ap.add_argument("--load-fraction", type=float, default=0.7, help="offered load as a fraction of capacity")
    ap.add_argument("--windows", default="0,2,5,10,20", help="shuttle windows to sweep, ms")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads for both sides; 0 = torch's default")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--reference-ops", action="store_true", help="keep the torch reference ops even when a compiled build is cached")
    args = ap.parse_args()
    # as `serve` starts: the ops built for the device the benchmark runs on (a GPU's sm_XY, else this CPU)
    compiled = startup_ops(arch_for(torch.device(args.device)), "reference" if args.reference_ops else "auto")
    print(f"ops: {', '.join(sorted(compiled)) or 'torch reference'} compiled")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.streams, args.gen, args.load_requests, args.windows = 8, 16, 24, "0,5"
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_default_model(tmp, DEFAULT_CONFIG, seed=0))
        model, tok = load_model(model_dir, args.dtype, args.device), Tokenizer(model_dir)
        vocab = model.config.vocab_size
        base = EngineConfig(kv_cache_bytes=512 << 20, max_num_seqs=64, max_batch_tokens=2048, dtype=args.dtype,
                            device=args.device)

        def fresh(**kw) -> LLMEngine:
            engine = LLMEngine(model, tok, base.model_copy(update=kw))
            engine.start()
            engine.warm_up()
            return engine

        batch = prompts(args.streams, args.prompt_len, vocab, seed=1)
        engine = fresh(max_wait_ms=0)
        engine_throughput(engine, batch[:4], 4)
        ours = engine_throughput(engine, batch, args.gen)
        b1 = batch1_decode(engine, batch[0], args.gen)
        engine.stop()
        hf = hf_throughput(model_dir, batch, args.gen, dtype, args.device)
        bw = copy_bandwidth(args.device)
        active_bytes = model.config.param_count(active=True) * torch.empty((), dtype=dtype).element_size()
        roofline = bw / active_bytes

        print(f"\n(a) throughput, default model ({model.config.param_count() / 1e6:.0f}M params, "
              f"{model.config.param_count(active=True) / 1e6:.0f}M active), {args.dtype}, "
              f"{args.device}, {torch.get_num_threads()} threads, {args.streams} streams x {args.prompt_len} prompt + {args.gen} generated tokens")
        print(f"{'':34}{'tokens/s':>12}")
        print(f"{f'tideflow engine, {args.streams} streams':34}{ours:12.1f}")
        print(f"{f'transformers generate(), batch {args.streams}':34}{hf:12.1f}")
        print(f"{'ratio (target >= 3x)':34}{ours / hf:11.2f}x")
        print(f"{'batch-1 decode':34}{b1:12.1f}")
        print(f"{'memory roofline':34}{roofline:12.1f}   ({bw / 1e9:.1f} GB/s copy, {active_bytes / 1e6:.0f} MB active/token)")
        print(f"{'batch-1 / roofline (target >= 70%)':34}{100 * b1 / roofline:11.1f}%")

        per_request = args.load_prompt_len + args.load_gen
        load_batch = prompts(args.load_requests, args.load_prompt_len, vocab, seed=2)
        engine = fresh(max_wait_ms=0)
        t0 = time.perf_counter()
        engine.generate(load_batch[:args.streams], SamplingParams(max_tokens=args.load_gen, ignore_eos=True))
        capacity = args.streams / (time.perf_counter() - t0)
        engine.stop()
        rate = args.load_fraction * capacity
        arrivals = bursty_arrivals(rate, args.load_requests, mean_burst=4.0, seed=3)
        print(f"\n(b) shuttle window, bursty Poisson load: {rate:.2f} req/s ({100 * args.load_fraction:.0f}% of "
              f"{capacity:.2f} req/s capacity), {args.load_requests} requests of {per_request} tokens, mean burst 4")
        print(f"{'window ms':>10}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}{'tokens/s':>12}{'p50 vs 0':>10}{'tok/s vs 0':>12}")
        results = {}
        for w in [float(x) for x in args.windows.split(",")]:
            engine = fresh(max_wait_ms=w)
            results[w] = r = run_load(engine, arrivals, load_batch, args.load_gen)
            engine.stop()
            zero = results.get(0.0, r)
            print(f"{w:10.0f}{1e3 * r['ttft_p50']:14.1f}{1e3 * r['ttft_p99']:14.1f}{r['tok_s']:12.1f}"
                  f"{r['ttft_p50'] / zero['ttft_p50']:10.2f}{r['tok_s'] / zero['tok_s']:12.2f}")
        best = min(results, key=lambda w: results[w]["ttft_p50"])
        print(f"best window by TTFT p50: {best:.0f} ms")


if __name__ == "__main__":
    main()
