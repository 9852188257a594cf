"""Disaggregation costs, each against its baseline in the same run.

1. KV transfer throughput of each transport vs this machine's memcpy bandwidth.
2. TTFT of a 1P+1D group vs a colocated group at 2k-token prompts: the transfer overhead as a
   share of prefill time (target: under 5%).
3. Router overhead: added p50/p99 latency per request vs calling the engine directly.

Run: python benchmarks/pd.py [--prompt-tokens 2048] [--requests 5] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model  # noqa: E402
from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.group.manager import GroupState  # noqa: E402
from engine.group.spec import InferenceGroup  # noqa: E402
from engine.transfer import make_receiver, make_sender  # noqa: E402


def transport_rates(nbytes: int, repeats: int) -> list[list[object]]:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    memcpy = nbytes / best / 1e9
    rows = [["memcpy (torch copy_)", memcpy, 1.0]]
    for kind in ("shm", "tcp"):
        sender, receiver = make_sender(kind), make_receiver(kind)
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            view = sender.stage(f"bench{i}", nbytes)
            torch.frombuffer(view, dtype=torch.uint8).copy_(src)  # export: cache -> staging
            view.release()
            desc = sender.commit(f"bench{i}")
            got = receiver.fetch(desc, timeout_s=60)
            dst.copy_(torch.frombuffer(got, dtype=torch.uint8))  # import: staging -> cache
            got.release()
            receiver.release(desc)
            times.append(time.perf_counter() - t0)
        sender.close()
        rate = nbytes / min(times) / 1e9
        rows.append([f"{kind} (export + fetch + import)", rate, rate / memcpy])
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ttft(client: httpx.Client, url: str, prompt: list[int]) -> float:
    body = {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and '"text":"' in line.replace(" ", "") and '"text":""' not in line.replace(" ", ""):
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def latency(client: httpx.Client, url: str, n: int) -> list[float]:
    body = {"model": "default", "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--latency-requests", type=int, default=60)
    ap.add_argument("--transfer-mb", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="use the 2-layer test model")
    args = ap.parse_args()

    print("== KV transfer throughput ==")
    print_table(["path", "GB/s", "vs memcpy"], transport_rates(args.transfer_mb * 2**20, 5))

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        config = TINY_CONFIG if args.tiny else DEFAULT_CONFIG
        model_dir = write_default_model(Path(tmp) / "model", config)
        kv = 64 * 2**20 * (1 if args.tiny else 8)
        engine = {"kv_cache_bytes": kv, "max_wait_ms": 0, "max_batch_tokens": args.prompt_tokens + 64}
        pd = InferenceGroup.model_validate({"name": "pd", "version": "v1", "model": {"path": str(model_dir)},
                                            "roles": [{"role": "prefill", "engine": engine}, {"role": "decode", "engine": engine}]})
        colo = InferenceGroup.model_validate({"name": "colo", "version": "v1", "model": {"path": str(model_dir)},
                                              "roles": [{"role": "colocated", "engine": engine}]})
        with LocalGroupSet(GroupSetConfig(model_dir=model_dir)) as gs:
            groups = [gs.up(pd, weight=0), gs.up(colo, weight=0)]
            for g in groups:
                if g.wait_for({GroupState.READY, GroupState.FAILED}, 600) != GroupState.READY:
                    raise SystemExit(f"group {g.spec.name} failed: {g.status.events[-1].message}")
            headers = {"authorization": f"Bearer {gs.client_key}"}
            gen = torch.Generator().manual_seed(0)
            rows = {}
            with httpx.Client(headers=headers, trust_env=False) as client:
                for name in ("colo", "pd"):
                    gs.admin.set_weights({"colo": float(name == "colo"), "pd": float(name == "pd")})
                    ttft(client, gs.url, torch.randint(0, config.vocab_size, (32,), generator=gen).tolist())
                    rows[name] = [ttft(client, gs.url, torch.randint(0, config.vocab_size, (args.prompt_tokens,),
                                                                       generator=gen).tolist())
                                  for _ in range(args.requests)]
                colo_ttft, pd_ttft = statistics.median(rows["colo"]), statistics.median(rows["pd"])
                print(f"\n== TTFT at {args.prompt_tokens}-token prompts ({config.param_count() / 1e6:.0f}M model, "
                      f"median of {args.requests}) ==")
                print_table(["group", "TTFT ms", "vs colocated"],
                            [["colocated", colo_ttft * 1e3, 1.0], ["1P+1D (shm)", pd_ttft * 1e3, pd_ttft / colo_ttft]])
                print(f"transfer overhead: {(pd_ttft - colo_ttft) * 1e3:.0f} ms = "
                      f"{(pd_ttft - colo_ttft) / colo_ttft:.1%} of prefill time (target < 5%)")

                gs.admin.set_weights({"colo": 1.0, "pd": 0.0})
                engine_url = next(m.endpoint for m in groups[1].status.members)
                member_headers = {"authorization": f"Bearer {gs.backend.api_key}"}
                with httpx.Client(headers=member_headers, trust_env=False) as direct:
                    latency(direct, engine_url, 5)
                    d = latency(direct, engine_url, args.latency_requests)
                latency(client, gs.url, 5)
                r = latency(client, gs.url, args.latency_requests)
            print(f"\n== router overhead ({args.latency_requests} sequential 4-token requests) ==")
            print_table(["path", "p50 ms", "p99 ms"],
                        [["engine direct", pct(d, .5) * 1e3, pct(d, .99) * 1e3],
                         ["through router", pct(r, .5) * 1e3, pct(r, .99) * 1e3],
                         ["added by router", (pct(r, .5) - pct(d, .5)) * 1e3, (pct(r, .99) - pct(d, .99)) * 1e3]])


if __name__ == "__main__":
    main()
