"""Multi-turn chat with a KV cache too small for the live conversations: time to first token with the KV tiers below
the cache against the cache alone, in one run on the same server flags and the same conversations.

    python benchmarks/kv_tiers.py [--conversations 48] [--turns 6] [--system 1024] [--question 64] [--answer 32]
                                  [--rate 2] [--think-s 4] [--kv-share 0.25] [--configs none host disk pair-precise ...]

Every conversation shares one system prompt of `--system` tokens. Conversations start as a Poisson process of
`--rate` per second; each turn sends the whole history (system prompt, every earlier question and answer) plus a
new question of `--question` tokens, streams `--answer` tokens back greedily, and after an exponential think time
of mean `--think-s` sends the next. The device KV cache holds the system prompt and `--kv-share` of the
conversations' final histories (a quarter by default: the others' blocks are evicted between their turns).

Configs, each a fresh `tideflow serve` of the default model:
    none   the KV cache alone (what a member without tiers does: an evicted history is computed again)
    host   + host memory (--kv-host-bytes) holding half the conversations' histories
    disk   + a local disk directory below the same host memory
    pair-precise, pair-approximate, pair-least-queued
           two members, each with half the KV cache and half the host memory, one compute thread each, sharing a
           directory as the store (G4), behind a `tideflow router` that places prompts by the members' KV event
           feeds (precise), by where it sent each prefix before (approximate), or by load alone (least-queued)
Printed per config: TTFT p50 / p99 of turns >= 2 and of first turns, output tokens/s, the share of prompt tokens
served from cache (each answer's usage.prompt_tokens_details.cached_tokens, the serving engine's own count), and for
the single members the token hit rate of each tier from the server's counters (tideflow_kv_tier_hit_tokens_total /
_queried_tokens_total) and the pool's own. The answers of every config are compared with those of `none`: greedy
outputs must be the same. Targets (issue #39): TTFT p50 of turns >= 2 <= 0.4x of `none`'s; precise routing's cached
share >= approximate's + 20 points. The ceiling column is the share of prompt tokens that a cache holding every block
ever computed, shared by all members, could serve (CacheCeiling): no placement caches more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, write_default_model  # noqa: E402
from drills.workload import PromptSynthesizer  # noqa: E402
from engine.model.paged import kv_bytes_per_block  # noqa: E402
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok  # noqa: E402
from engine.router.app import ADMIN_KEYS_ENV, UPSTREAM_KEY_ENV  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402

KEY = "kv-tiers-bench"  # one key for every conversation: members run without a per-key token cap
ADMIN = "kv-tiers-bench-admin"
BLOCK = 16


def start(model_dir: Path, name: str, extra: list[str], log_dir: Path) -> tuple[Child, str]:
    port = free_port()
    argv = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--served-model-name", "default",
                         "--kernels", "auto", "--block-size", str(BLOCK), "--max-client-tokens", "0", *extra)
    child = Child(f"serve-{name}", argv, log_dir / f"serve-{name}.log", {"TIDEFLOW_API_KEYS": KEY})
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ok(url + "/ready", 900, child):
        raise SystemExit(f"tideflow serve ({name}) did not get ready: {child.log_tail()}")
    return child, url


async def turn(client: openai.AsyncOpenAI, prompt: str, answer: int) -> tuple[float, str, int, int, int]:
    """TTFT, the answer's text and its tokens, the prompt's tokens and how many of them were cached (the serving
    engine's own count, in the usage of the last chunk). Each token is a chunk of its own (logprobs=0): a stream
    sends no text until a character is whole, which would move a first token of the default model's random weights
    late."""
    t0 = time.perf_counter()
    first, text, tokens, prompt_tokens, cached = None, [], 0, 0, 0
    stream = await client.completions.create(model="default", prompt=prompt, max_tokens=answer, temperature=0,
                                             logprobs=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
            if first is None:
                first = time.perf_counter() - t0
            tokens += len(chunk.choices[0].logprobs.tokens)
        if chunk.choices:
            text.append(chunk.choices[0].text or "")
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else 0
    return (first if first is not None else float("nan")), "".join(text), tokens, prompt_tokens, cached


class CacheCeiling:
    """The share of prompt tokens any cache could have served: a cache that never forgets, shared by every member,
    holding each full block computed so far (prompts as sent, and each prompt with its answer once it is back). No
    placement can cache more than this; the pair configs' cached share is read against it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.seen, self.prompt, self.reusable = tokenizer, set(), 0, 0

    def _hashes(self, ids: list[int]) -> list[int]:
        out, prev = [], 0
        for i in range(len(ids) // BLOCK):
            prev = hash((prev, tuple(ids[i * BLOCK : (i + 1) * BLOCK])))
            out.append(prev)
        return out

    def sent(self, prompt: str) -> None:
        ids = self.tokenizer.encode(prompt)
        hashes = self._hashes(ids)
        run = 0
        for h in hashes[: (len(ids) - 1) // BLOCK]:  # the last token is always computed
            if h not in self.seen:
                break
            run += 1
        self.prompt, self.reusable = self.prompt + len(ids), self.reusable + run * BLOCK
        self.seen.update(hashes)

    def answered(self, prompt: str, answer: str) -> None:
        self.seen.update(self._hashes(self.tokenizer.encode(prompt + answer)))

    @property
    def share(self) -> float:
        return self.reusable / max(1, self.prompt)


async def workload(url: str, system: str, questions: list[list[str]], args, ceiling: CacheCeiling) -> dict:
    """Run every conversation; TTFTs by turn kind, answers by (conversation, turn), tokens/s."""
    rng = random.Random(1)
    starts = np.cumsum([rng.expovariate(args.rate) for _ in questions])
    thinks = [[rng.expovariate(1 / args.think_s) for _ in range(args.turns)] for _ in questions]
    ttft_first, ttft_later, answers, received, prompts = [], [], {}, [0], [0, 0]  # prompt tokens, cached of them

    async def conversation(c: int, client: openai.AsyncOpenAI) -> None:
        await asyncio.sleep(starts[c])
        history = system
        for t, question in enumerate(questions[c]):
            history += "\n" + question
            ceiling.sent(history)
            ttft, text, tokens, prompt_tokens, cached = await turn(client, history, args.answer)
            ceiling.answered(history, text)
            (ttft_first if t == 0 else ttft_later).append(ttft)
            answers[(c, t)] = text
            received[0] += tokens
            prompts[0] += prompt_tokens
            prompts[1] += cached
            history += text
            await asyncio.sleep(thinks[c][t])

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=900) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, client) for c in range(len(questions))))
        took = time.perf_counter() - t0
    return {"first": ttft_first, "later": ttft_later, "answers": answers, "tok_s": received[0] / took,
            "cached": prompts[1] / max(1, prompts[0]), "ceiling": ceiling.share}


def counters(url: str) -> dict[tuple[str, str], float]:
    """(sample name, tier) -> value of the server's KV counters."""
    body = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name.startswith(("tideflow_kv_tier_", "tideflow_prefix_cache_")):
                where = (sample.name, sample.labels.get("tier", ""))
                out[where] = out.get(where, 0.0) + sample.value  # fallbacks: summed over their reasons
    return out


def rate(found: dict, hit: str, queried: str, tier: str = "") -> str:
    q = found.get((queried, tier), 0.0)
    return f"{100 * found.get((hit, tier), 0.0) / q:.0f} %" if q else "-"


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


PAIR_CONFIGS = ("pair-precise", "pair-approximate", "pair-least-queued")


def start_pair(model_dir: Path, mode: str, member_flags: list[str], log_dir: Path) -> tuple[list[Child], str]:
    """Two members on one thread each, sharing a store, behind a `tideflow router` placing prompts by `mode`."""
    children, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            argv = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--served-model-name",
                                 "default", "--kernels", "auto", "--block-size", str(BLOCK), "--threads", "1",
                                 "--max-client-tokens", "0", *member_flags)
            children.append(Child(f"member-{mode}-{i}", argv, log_dir / f"member-{mode}-{i}.log",
                                  {"TIDEFLOW_API_KEYS": KEY}))
            urls.append(f"http://127.0.0.1:{port}")
        for child, url in zip(children, urls):
            if not wait_http_ok(url + "/ready", 900, child):
                raise SystemExit(f"member did not get ready: {child.log_tail()}")
        port = free_port()
        argv = tideflow_argv("router", "--port", str(port), "--model-dir", str(model_dir), "--kv-routing", mode)
        children.append(Child(f"router-{mode}", argv, log_dir / f"router-{mode}.log",
                              {"TIDEFLOW_API_KEYS": KEY, ADMIN_KEYS_ENV: ADMIN, UPSTREAM_KEY_ENV: KEY}))
        router_url = f"http://127.0.0.1:{port}"
        if not wait_http_ok(router_url + "/health", 60, children[-1]):
            raise SystemExit(f"router did not get ready: {children[-1].log_tail()}")
        r = httpx.post(router_url + "/admin/groups", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30,
                       json={"name": "pair", "version": "v1", "weight": 1.0,
                             "endpoints": [{"url": u, "role": "colocated"} for u in urls]})
        r.raise_for_status()
        return children, router_url
    except BaseException:
        for child in children:
            child.stop()
        raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--rate", type=float, default=2.0, help="conversations started per second (Poisson)")
    ap.add_argument("--think-s", type=float, default=4.0, help="mean pause between an answer and the next question")
    ap.add_argument("--kv-share", type=float, default=0.25, help="share of the conversations whose history fits the KV")
    ap.add_argument("--configs", nargs="+", default=["none", "host", "disk", *PAIR_CONFIGS],
                    choices=["none", "host", "disk", *PAIR_CONFIGS])
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="one more `tideflow serve` argument")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its servers

    with tempfile.TemporaryDirectory(prefix="tideflow-kv-tiers-") as tmp:
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        synth, tokenizer = PromptSynthesizer(np.random.default_rng(0), model_dir), Tokenizer(model_dir)
        system = synth.make(args.system)[0]
        questions = [[synth.make(args.question)[0] for _ in range(args.turns)] for _ in range(args.conversations)]
        per_token = kv_bytes_per_block(DEFAULT_CONFIG, BLOCK) // BLOCK
        history = args.turns * (args.question + args.answer)  # a conversation's own tokens at its last turn
        kv_bytes = per_token * int(args.system + 2 * BLOCK * args.conversations
                                   + args.kv_share * args.conversations * history)
        host_bytes = per_token * int(args.system + 0.5 * args.conversations * history)
        flags = {"none": [], "host": ["--kv-host-bytes", str(host_bytes)],
                 "disk": ["--kv-host-bytes", str(host_bytes), "--kv-disk-path", str(Path(tmp) / "disk")]}
        results, rows = {}, []
        for name in args.configs:
            if name in PAIR_CONFIGS:  # the same device KV and host memory in all, split over two members
                store = (Path(tmp) / f"store-{name}").as_uri() + "/"
                tiers = json.dumps({"host_bytes": host_bytes // 2, "store_url": store, "store_min_uses": 1})
                half = max(kv_bytes // 2, per_token * (args.system + history + 4 * BLOCK + args.answer))  # one
                # conversation's whole history fits a member, however few conversations are run
                children, url = start_pair(model_dir, name.removeprefix("pair-"),
                                           ["--kv-cache-bytes", str(half), "--kv-tiers", tiers,
                                            *args.serve_arg], Path(tmp))
            else:
                child, url = start(model_dir, name, ["--kv-cache-bytes", str(kv_bytes), *flags[name], *args.serve_arg],
                                   Path(tmp))
                children = [child]
            try:
                results[name] = asyncio.run(workload(url, system, questions, args, CacheCeiling(tokenizer)))
                found = counters(url) if name not in PAIR_CONFIGS else {}
            finally:
                for child in children:
                    child.stop()
            r = results[name]
            base = results.get("none", r)
            same = "-" if name == "none" or "none" not in results else \
                f"{sum(base['answers'][k] == v for k, v in r['answers'].items())}/{len(r['answers'])}"
            later = statistics.median(r["later"])
            rows.append([name, f"{later * 1000:.0f} / {pct(r['later'], 0.99) * 1000:.0f}",
                         f"{later / statistics.median(base['later']):.2f}x" if "none" in results else "-",
                         f"{statistics.median(r['first']) * 1000:.0f} / {pct(r['first'], 0.99) * 1000:.0f}",
                         f"{r['tok_s']:.0f}", f"{100 * r['cached']:.0f} %", f"{100 * r['ceiling']:.0f} %",
                         rate(found, "tideflow_prefix_cache_hit_blocks_total", "tideflow_prefix_cache_queried_blocks_total"),
                         *(rate(found, "tideflow_kv_tier_hit_tokens_total", "tideflow_kv_tier_queried_tokens_total", t)
                           for t in ("host", "disk")),
                         f"{sum(v for (n, _), v in found.items() if n == 'tideflow_kv_tier_offload_skipped_blocks_total'):.0f}"
                         f" / {sum(v for (n, _), v in found.items() if n == 'tideflow_kv_tier_fallbacks_total'):.0f}",
                         same])
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"host: {host()}; {args.conversations} conversations x {args.turns} turns, system {args.system}, question "
          f"{args.question}, answer {args.answer} tokens; {args.rate:g} conversations/s, think {args.think_s:g} s; "
          f"KV cache {kv_bytes >> 20} MiB ({args.kv_share:g} of the histories), host tier {host_bytes >> 20} MiB "
          f"(pair-*: half of each per member, one thread each, a shared directory store)")
    print_table(["config", "TTFT turns>=2 p50 / p99 ms", "p50 vs none", "TTFT turn 1 p50 / p99 ms", "output tok/s",
                 "prompt tokens cached", "ceiling (any cache)", "pool hit (blocks)", "host hit (tokens)", "disk hit (tokens)",
                 "offloads skipped / fallbacks", "answers same as none"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
