"""The expert load balancer in service: a DEP2 instance of `tideflow serve` on skewed expert routing, without
replicas, with replicas placed at start, and with replicas moved live, in one run on the same prompts.

    python benchmarks/eplb_serving.py [--zipf 1.0 1.5] [--streams 8] [--requests 48] [--prompt 64] [--new 48]
                                      [--redundant 2] [--interval 32] [--shift] [--sizes 1 2 4]

The default model's routers are biased toward a hot set of experts, Zipf-ranked with exponent s, the hottest
half being the experts rank 0 holds without replicas (the imbalance the expert LB exists to fix): every token
embedding gets a common direction (twice a row's norm), and each MoE layer's gate rows an offset of -s * log(rank)
(in units of the gate logits' spread over tokens, so their choices follow the Zipf weights about as a softmax
router's would) along the mean direction of the hidden states the gate sees (measured on sample prompts), so a token adds about
that offset to its logits, in proportion to its own projection on that direction. What the
routing became is measured, not assumed: the ranks' own counters of tokens routed to each expert give the expert
skew (max/mean), and their counters of (token, expert) pairs each rank's experts computed give the rank load
(max/mean over the two ranks) the expert LB exists to even out.

Configs, each a fresh pair of `tideflow serve --dep-size 2` ranks, `--streams` streams on each rank:
    none     no replicas (contiguous experts)
    static   `--redundant` replica slots placed at start for an even load (not told the skew), never moved
    live     the same slots, rebalanced from the measured load (checked every `--interval` steps; applied when max/mean
             rank load exceeds 1.1 and the plan cuts it by 5 %, the defaults)
With `--shift` the hot set moves mid-run: tokens of the vocabulary's first half prefer rank 0's experts, those
of its second half rank 1's (each topic its own embedding direction and gate offset), and each config serves
`--requests` a rank from the first half, then as many from the second on the same ranks: a row before the
shift and one after it, the live row's showing whether its moves followed.
With `--sizes` it also prints the trade-off of the DEP size on unskewed routing: each size as `size` ranks sharing
the host's cores, the same total streams and requests split over them, total output tok/s against each user's
tok/s (1 / TPOT p50), the table capacity planning reads.
Printed per Zipf exponent and config: output tokens/s over both ranks, TTFT and TPOT p50, rank load max/mean, the
expert skew, live rebalances applied and the seconds they stalled the instance against the run's. Targets (issue #41): live rank load <= 1.10 at Zipf 1.5; throughput >= 1.15x
`none` at Zipf 1.5 on DEP2.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from engine.offline.generate import generate  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok  # noqa: E402

KEY = "eplb-bench"


HALF = DEFAULT_CONFIG.vocab_size // 2
TOPICS = {"all": (5, DEFAULT_CONFIG.vocab_size), "first": (5, HALF), "second": (HALF, DEFAULT_CONFIG.vocab_size)}


def skew_routing(model_dir: Path, exponent: float, shift: bool = False, seed: int = 0) -> dict[str, list[int]]:
    """Bias every MoE gate toward a hot set, in the checkpoint; returns each topic's experts from hottest to coldest.
    Without `shift` one hot set (the experts rank 0 holds) for every token; with it, tokens of the vocabulary's first
    half prefer that set and tokens of its second half the set rank 1 holds: prompts drawn from the second half
    after the first shift the hot set mid-run."""
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    topics = ["first", "second"] if shift else ["all"]
    # one direction every token of a topic carries (the random model's residual stream is mostly its embedding):
    # the gates' offsets along it then reach nearly every such token, as a router's learned preference would
    embed = state["model.embed_tokens.weight"].float()
    lift = 2 * embed.norm(dim=1).mean()
    gen = torch.Generator().manual_seed(seed)
    for topic in topics:
        direction = torch.randn(embed.shape[1], generator=gen)
        low, high = TOPICS[topic]
        embed[low:high] += lift * direction / direction.norm()
    state["model.embed_tokens.weight"] = embed.to(state["model.embed_tokens.weight"].dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    model = load_model(model_dir)
    rng = random.Random(seed)
    inputs: dict[str, list[torch.Tensor]] = {}  # per topic: the gate inputs of each MoE layer on sample prompts
    for topic in topics:
        seen: dict[int, list[torch.Tensor]] = {}
        hooks = [moe.gate.register_forward_pre_hook(lambda _m, args, j=j: seen.setdefault(j, []).append(args[0].float()))
                 for j, moe in enumerate(model.moe_layers())]
        generate(model, None, [topic_prompt(rng, topic, 48) for _ in range(8)], SamplingParams(max_tokens=4, ignore_eos=True))
        for hook in hooks:
            hook.remove()
        inputs[topic] = [torch.cat(seen[j]) for j in sorted(seen)]
    half = DEFAULT_CONFIG.num_experts // 2  # without replicas rank 0 holds the first half, rank 1 the second
    first, second = list(range(half)), list(range(half, DEFAULT_CONFIG.num_experts))
    rng.shuffle(first)
    rng.shuffle(second)
    orders = {"all": first + second, "first": first + second, "second": second + first}
    state = load_file(str(path))
    layers = [i for i in range(DEFAULT_CONFIG.num_layers) if DEFAULT_CONFIG.is_moe_layer(i)]
    for j, layer in enumerate(layers):
        name = f"model.layers.{layer}.block_sparse_moe.gate.weight"
        gate = state[name].float()
        basis = torch.stack([inputs[t][j].mean(0) for t in topics])  # (topics, hidden): the mean gate inputs
        dual = torch.linalg.pinv(basis).t()  # dual[t] . basis[u] = 1 if t == u else 0: each topic its own offset
        plain = gate - (gate @ dual.t()) @ basis  # no preference of its own along the topics' directions
        biased = plain.clone()
        for t, topic in enumerate(topics):
            offset = torch.zeros(DEFAULT_CONFIG.num_experts)
            for rank, expert in enumerate(orders[topic]):
                offset[expert] = -exponent * math.log(rank + 1)
            # in units of the logits' own spread over tokens, as Gumbel noise (sd pi / sqrt(6)) would make a softmax
            # router's choices follow the Zipf weights
            spread = float((inputs[topic][j] @ plain.t()).std(0).mean()) / (math.pi / math.sqrt(6))
            biased += torch.outer(spread * offset, dual[t])
        state[name] = biased.to(state[name].dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    return {t: orders[t] for t in topics}


def topic_prompt(rng: random.Random, topic: str, n: int) -> list[int]:
    low, high = TOPICS[topic]
    return [rng.randrange(low, high) for _ in range(n)]


def start_ranks(model_dir: Path, config: str, args, log_dir: Path, size: int = 2,
                threads: int = 1) -> tuple[list[Child], list[str]]:
    """`size` ranks of one DEP instance (`size` 1: a plain `tideflow serve`), `threads` compute threads each."""
    dist_port = free_port()
    extra = {"none": [], "static": ["--redundant-experts", str(args.redundant), "--eplb-interval-steps", "100000000"],
             "live": ["--redundant-experts", str(args.redundant), "--eplb-interval-steps", str(args.interval)]}[config]
    children, urls = [], []
    try:
        for rank in range(size):
            port = free_port()
            dep = ["--dep-rank", str(rank), "--dep-size", str(size), "--dist-addr", f"127.0.0.1:{dist_port}"] if size > 1 else []
            argv = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--served-model-name",
                                 "default", "--threads", str(threads), "--max-client-tokens", "0", "--max-wait-ms", "0",
                                 "--kv-cache-bytes", str(64 << 20), *dep, *extra)
            children.append(Child(f"dep{size}-{config}-{rank}", argv, log_dir / f"dep{size}-{config}-{rank}.log",
                                  {"TIDEFLOW_API_KEYS": KEY}))
            urls.append(f"http://127.0.0.1:{port}")
        for child, url in zip(children, urls):
            if not wait_http_ok(url + "/ready", 900, child):
                raise SystemExit(f"rank did not get ready: {child.log_tail()}")
        return children, urls
    except BaseException:
        for child in children:
            child.stop()
        raise


def counters(url: str) -> dict[str, float]:
    body = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            name = sample.name
            if name == "tideflow_expert_routed_tokens_total":
                name += f"/{sample.labels['layer']}/{sample.labels['expert']}"
            out[name] = out.get(name, 0.0) + sample.value
    return out


async def load(urls: list[str], args, topic: str) -> dict:
    """`--streams` closed-loop streams per rank until `--requests` per rank are answered, prompts drawn from the
    topic's tokens; TTFTs, TPOTs, tokens."""
    ttft, tpot, tokens = [], [], [0]
    rng = random.Random(7)

    async def stream(client: openai.AsyncOpenAI, todo: list[int]) -> None:
        while todo:
            todo.pop()
            prompt = topic_prompt(rng, topic, args.prompt)
            t0 = time.perf_counter()
            first, n = None, 0
            chunks = await client.completions.create(model="default", prompt=prompt, max_tokens=args.new,
                                                     temperature=0, stream=True, logprobs=0,
                                                     extra_body={"ignore_eos": True})
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                    n += len(chunk.choices[0].logprobs.tokens)
                    if first is None:
                        first = time.perf_counter() - t0
            took = time.perf_counter() - t0
            ttft.append(first)
            if n > 1:
                tpot.append((took - first) / (n - 1))
            tokens[0] += n

    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key=KEY, max_retries=0, timeout=900) for u in urls]
    t0 = time.perf_counter()
    try:
        queues = [list(range(args.requests)) for _ in urls]
        await asyncio.gather(*(stream(c, q) for c, q in zip(clients, queues) for _ in range(args.streams)))
    finally:
        for c in clients:
            await c.close()
    took = time.perf_counter() - t0
    return {"tok_s": tokens[0] / took, "ttft": statistics.median(ttft), "tpot": statistics.median(tpot), "took": took}


def measure(model_dir: Path, config: str, args, log_dir: Path, topics: list[str]) -> list[list[str]]:
    """One row per topic, in turn on the same ranks (with two topics the hot set shifts between the rows)."""
    children, urls = start_ranks(model_dir, config, args, log_dir)
    rows = []
    try:
        for topic in topics:
            before = [counters(u) for u in urls]
            served = asyncio.run(load(urls, args, topic))
            time.sleep(1.0)  # the last scrape after the answers (the pairs counter lags each rank by < 16 steps)
            after = [counters(u) for u in urls]
            label = config if topic == "all" else f"{config}, {'before' if topic == 'first' else 'after'} the shift"
            rows.append(figures(label, served, before, after))
    finally:
        for child in children:
            child.stop()
    return rows


def trade_off(model_dir: Path, size: int, args, log_dir: Path) -> list[str]:
    """One DEP size on unskewed routing and the same total load: `--streams` x 2 streams and `--requests` x 2
    requests split over the ranks, the host's cores split over them (at least one thread a rank)."""
    cores = os.cpu_count() or 2
    threads = max(1, cores // size)
    total_streams, total_requests = 2 * args.streams, 2 * args.requests
    per_rank = argparse.Namespace(**{**vars(args), "streams": max(1, total_streams // size),
                                     "requests": max(1, total_requests // size)})
    children, urls = start_ranks(model_dir, "none", args, log_dir, size, threads)
    try:
        served = asyncio.run(load(urls, per_rank, "all"))
    finally:
        for child in children:
            child.stop()
    oversubscribed = " (more threads than cores)" if size * threads > cores else ""
    return [f"DEP{size}", f"{size} x {threads}{oversubscribed}", f"{per_rank.streams}", f"{served['tok_s']:.0f}",
            f"{1.0 / served['tpot']:.1f}", f"{served['tpot'] * 1000:.1f}", f"{served['ttft'] * 1000:.0f}"]


def figures(label: str, served: dict, before: list[dict], after: list[dict]) -> list[str]:
    delta = [{k: a[k] - b.get(k, 0.0) for k in a} for a, b in zip(after, before)]
    computed = [d.get("tideflow_expert_computed_pairs_total", 0.0) for d in delta]
    routed: dict[str, float] = {}
    for d in delta:
        for k, v in d.items():
            if k.startswith("tideflow_expert_routed_tokens_total/"):
                routed[k] = routed.get(k, 0.0) + v
    per_layer: dict[str, list[float]] = {}
    for k, v in routed.items():
        per_layer.setdefault(k.split("/")[1], []).append(v)
    skew = statistics.mean(max(v) / statistics.mean(v) for v in per_layer.values() if sum(v)) if per_layer else float("nan")
    rank_load = max(computed) / statistics.mean(computed) if sum(computed) else float("nan")
    rebalances = delta[0].get("tideflow_expert_rebalances_total", 0.0)
    moves = delta[0].get("tideflow_expert_rebalance_seconds_sum", 0.0)
    return [label, f"{served['tok_s']:.0f}", f"{served['ttft'] * 1000:.0f}", f"{served['tpot'] * 1000:.1f}",
            f"{rank_load:.3f}", f"{skew:.2f}", f"{rebalances:.0f}", f"{moves:.2f} / {served['took']:.1f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zipf", type=float, nargs="*", default=[1.0, 1.5], help="skews to run (none given: only --sizes)")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams on each rank")
    ap.add_argument("--requests", type=int, default=48, help="requests per rank")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--redundant", type=int, default=2, help="replica slots per MoE layer (static and live)")
    ap.add_argument("--interval", type=int, default=32, help="live: steps between rebalance checks")
    ap.add_argument("--configs", nargs="+", default=["none", "static", "live"], choices=["none", "static", "live"])
    ap.add_argument("--sizes", type=int, nargs="*", default=[], metavar="N",
                    help="also the DEP-size trade-off on unskewed routing: per-user tok/s against total throughput "
                         "for each size (e.g. 1 2 4), the same total load and cores")
    ap.add_argument("--shift", action="store_true", help="two hot sets: `--requests` a rank on rank 0's hot experts, "
                                                         "then as many on rank 1's, on the same ranks")
    args = ap.parse_args()
    topics = ["first", "second"] if args.shift else ["all"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tables = []
    with tempfile.TemporaryDirectory(prefix="tideflow-eplb-") as tmp:
        for s in args.zipf:
            model_dir = write_default_model(Path(tmp) / f"model-{s}", DEFAULT_CONFIG, seed=0)
            hot = skew_routing(model_dir, s, args.shift)
            per_config = []
            for config in args.configs:
                per_config.append(measure(model_dir, config, args, Path(tmp), topics))
                print(f"zipf {s} {config}: done", file=sys.stderr, flush=True)
            rows = []
            for t in range(len(topics)):  # each row against the first config's row of the same topic
                base = float(per_config[0][t][1])
                for config_rows in per_config:
                    row = list(config_rows[t])
                    row.insert(2, f"{float(row[1]) / base:.2f}x")
                    rows.append(row)
            tables.append((s, hot, rows))
        sizes = []
        if args.sizes:
            plain_dir = write_default_model(Path(tmp) / "model-plain", DEFAULT_CONFIG, seed=0)
            for size in args.sizes:
                sizes.append(trade_off(plain_dir, size, args, Path(tmp)))
                print(f"DEP{size}: done", file=sys.stderr, flush=True)
    print(f"host: {host()}; default model, DEP2 (two `tideflow serve` ranks, 1 thread each, gloo), {args.streams} "
          f"streams a rank, {args.requests} requests a rank of {args.prompt} in / {args.new} out; replicas: "
          f"{args.redundant} slots; live: a check every {args.interval} steps")
    for s, hot, rows in tables:
        print(f"\nZipf {s:g} (hot experts, hottest first: " + "; ".join(f"{t} tokens {o}" for t, o in hot.items()) + ")")
        print_table(["config", "output tok/s", f"vs {args.configs[0]}", "TTFT p50 ms", "TPOT p50 ms",
                     "rank load max/mean", "expert skew max/mean", "rebalances", "s moving / s run"], rows)
    if sizes:
        print(f"\nDEP size trade-off, unskewed routing, {2 * args.streams} streams and {2 * args.requests} requests "
              f"over the ranks, {os.cpu_count()} cores split over them")
        print_table(["size", "ranks x threads", "streams a rank", "output tok/s (all)", "per-user tok/s (1 / TPOT p50)",
                     "TPOT p50 ms", "TTFT p50 ms"], sizes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
