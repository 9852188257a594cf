"""Failover with request migration on vs off, in one run: a member SIGKILLed mid-stream under load.

Three modes: migration on (migration_limit 3) with the engine's defaults (the survivor may re-prefill every moved
request in one long step); migration on with a step target (`step_target_ms` 250, engine/core/step_cost.py: the
moved requests' prefill is spread over steps that keep the survivor's own streams flowing); migration off (0). Each mode gets its own router in front of two colocated groups. N greedy
streams run at once through the official openai client; once every stream has `--chunks` chunks, the
member of the group holding the most requests is SIGKILLed. Per stream we record errors, the longest pause
between two chunks, and, against an undisturbed run of the same requests, lost and duplicated tokens
(one chunk per token, from `logprobs=0`). The killed group is rebuilt before the next repeat. "in flight at kills"
is the router's count of requests on the killed group at each kill (a kill after they ended proves
nothing; on a fast model, pace the tokens with --token-delay-s).

    python benchmarks/failover.py            # the default model (~115M parameters)
    python benchmarks/failover.py --tiny     # the 2-layer test model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.canary.metrics import histogram_quantile  # noqa: E402
from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model  # noqa: E402
from drills.fault import token_diff  # noqa: E402
from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.group.manager import GroupState  # noqa: E402
from engine.group.spec import InferenceGroup  # noqa: E402
from engine.runtime.http import bearer_client  # noqa: E402
from engine.router.metrics import MIGRATION_STAGES  # noqa: E402


def spec(name: str, model_dir: Path, kv_bytes: int, engine: dict) -> InferenceGroup:
    return InferenceGroup.model_validate({
        "name": name, "version": "v1", "model": {"path": str(model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": kv_bytes, "max_wait_ms": 0, **engine}}]})


async def one(client: openai.AsyncOpenAI, i: int, max_tokens: int, progress: list[int]) -> dict:
    """One greedy stream: its tokens, and its longest pause between two tokens. The tokens come with their
    log-probabilities (`logprobs=0`) so that each is a chunk of its own: a byte token that completes no
    character yet would otherwise hold its text back to the next chunk and stretch the measured pause."""
    chunks, gaps, last = [], [], None
    try:
        stream = await client.completions.create(model="default", prompt=f"the fleet serves request {i} " * (1 + i % 4),
                                                 max_tokens=max_tokens, temperature=0, stream=True, logprobs=0,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                if last is not None:
                    gaps.append((now - last) * 1000)
                last = now
                chunks.extend(chunk.choices[0].logprobs.tokens)
                progress[i] += 1
    except openai.APIError as exc:
        return {"chunks": chunks, "gap": max(gaps, default=0.0), "error": f"{type(exc).__name__}: {exc}"[:200]}
    return {"chunks": chunks, "gap": max(gaps, default=0.0), "error": None}


async def streams(gs: LocalGroupSet, n: int, max_tokens: int, kill=None, chunks: int = 4) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=gs.url + "/v1", api_key=gs.client_key, max_retries=0, timeout=300)
    progress = [0] * n
    try:
        tasks = [asyncio.create_task(one(client, i, max_tokens, progress)) for i in range(n)]
        if kill is not None:
            t0 = time.monotonic()
            while min(progress) < chunks and not all(t.done() for t in tasks) and time.monotonic() - t0 < 120:
                await asyncio.sleep(0.002)
            await asyncio.to_thread(kill)
        return await asyncio.gather(*tasks)
    finally:
        await client.close()


def kill_busiest(gs: LocalGroupSet, groups: dict) -> tuple[str, int]:
    """SIGKILL the member of the group the router has the most requests on: (its name, those requests)."""
    held = {g["name"]: g["inflight"] for g in gs.admin.groups() if g["name"] in groups}
    name = max(held, key=held.get)
    pid = next(iter(gs.backend.pids(groups[name].status.handle).values()))
    os.kill(pid, signal.SIGKILL)
    return name, held[name]


def run_mode(model_dir: Path, limit: int, args, engine: dict) -> dict:
    with LocalGroupSet(GroupSetConfig(model_dir=model_dir, model_name="default",
                                      router_args=["--migration-limit", str(limit)])) as gs:
        if args.token_delay_s:
            plain = gs.backend.member_args
            pace = ["--faults", f'{{"token_delay_s": {args.token_delay_s}}}']
            gs.backend.member_args = lambda group, member, *a: plain(group, member, *a) + pace
        groups = {n: gs.up(spec(n, model_dir, args.kv_bytes, engine)) for n in ("fo-a", "fo-b")}
        for g in groups.values():
            if g.wait_for({GroupState.READY, GroupState.FAILED}, 600) != GroupState.READY:
                raise SystemExit(f"group {g.spec.name} did not start: {g.status.events[-3:]}")
        reference = asyncio.run(streams(gs, args.streams, args.max_tokens))
        if any(r["error"] for r in reference):
            raise SystemExit(f"the undisturbed run failed: {[r['error'] for r in reference if r['error']]}")
        out = {"errors": 0, "exact": 0, "lost": 0, "dup": 0, "gaps": [], "streams": 0, "held": 0}
        for repeat in range(args.repeats):
            killed: list[tuple[str, int]] = []
            got = asyncio.run(streams(gs, args.streams, args.max_tokens, lambda: killed.append(kill_busiest(gs, groups)),
                                      args.chunks))
            for want, r in zip(reference, got):
                lost, dup = token_diff(want["chunks"], r["chunks"])
                out["errors"] += r["error"] is not None
                out["exact"] += r["error"] is None and r["chunks"] == want["chunks"]
                out["lost"], out["dup"] = out["lost"] + lost, out["dup"] + dup
                out["gaps"].append(r["gap"])
            out["streams"] += len(got)
            out["held"] += killed[0][1]
            print(f"migration_limit={limit} repeat {repeat}: killed {killed[0][0]} with {killed[0][1]} requests in "
                  f"flight; {sum(r['error'] is not None for r in got)} errors", file=sys.stderr)
            fallen = groups[killed[0][0]]
            deadline = time.monotonic() + 30  # the fall is seen within the supervisor's poll: wait for it first
            while fallen.status.state == GroupState.READY and time.monotonic() < deadline:
                time.sleep(0.05)
            if fallen.wait_for({GroupState.READY, GroupState.FAILED}, 600) != GroupState.READY:
                raise SystemExit(f"group {killed[0][0]} was not rebuilt")
        out["migration"] = migration_pauses(gs)
        return out


def migration_pauses(gs: LocalGroupSet) -> dict[str, tuple[float | None, float | None]]:
    """p50/p99 (ms) of the router's tideflow_router_migration_seconds per stage, over every moved stream: how
    long from the break seen until another upstream answered, and until its first token was relayed."""
    with bearer_client(gs.client_key, gs.url, timeout_s=10.0) as http:
        text = http.get("/metrics").raise_for_status().text
    buckets: dict[str, dict[float, float]] = {stage: {} for stage in MIGRATION_STAGES}
    for family in text_string_to_metric_families(text):
        if family.name != "tideflow_router_migration_seconds":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                per = buckets[s.labels["stage"]]
                per[le] = per.get(le, 0.0) + s.value
    out = {}
    for stage, b in buckets.items():
        p50, p99 = histogram_quantile(0.5, b), histogram_quantile(0.99, b)
        out[stage] = (None if p50 is None else p50 * 1000, None if p99 is None else p99 * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of the default one")
    ap.add_argument("--streams", type=int, default=16, help="concurrent greedy streams per run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8, help="chunks every stream has before the kill")
    ap.add_argument("--token-delay-s", type=float, default=0.0,
                    help="members pace each token by this much (fault injector), like a larger model's TPOT")
    ap.add_argument("--repeats", type=int, default=3, help="kills per mode")
    ap.add_argument("--kv-bytes", type=int, default=256 * 2**20,
                    help="KV cache per member (the default holds every stream on one member after a kill: a member "
                         "short of blocks preempts and recomputes, which is another benchmark)")
    ap.add_argument("--engine", default="{}", help='more engine knobs of both groups, as JSON (e.g. \'{"max_batch_tokens": 512}\')')
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        model_dir = write_default_model(Path(tmp) / "model", TINY_CONFIG if args.tiny else DEFAULT_CONFIG, seed=0)
        knobs = json.loads(args.engine)
        results = {"on (limit 3)": run_mode(model_dir, 3, args, knobs),
                   "on, step target 250 ms": run_mode(model_dir, 3, args, {**knobs, "step_target_ms": 250}),
                   "off (limit 0)": run_mode(model_dir, 0, args, knobs)}
    rows = []
    for mode, r in results.items():
        rows.append([mode, r["streams"], r["held"], r["errors"], r["exact"], r["lost"], r["dup"],
                     float(np.percentile(r["gaps"], 50)), float(np.percentile(r["gaps"], 99))])
    print(f"\n{args.streams} greedy streams x {args.repeats} kills, {args.max_tokens} tokens each "
          f"({'tiny' if args.tiny else 'default'} model); gap = a stream's longest pause between two tokens")
    print_table(["migration", "streams", "in flight at kills", "errors", "exact answers", "lost tokens", "dup tokens", "gap p50 ms",
                 "gap p99 ms"], rows)
    on, off = results["on (limit 3)"], results["off (limit 0)"]
    print(f"errors: {on['errors']} with migration vs {off['errors']} without")
    for mode in ("on (limit 3)", "on, step target 250 ms"):
        for stage, (p50, p99) in results[mode]["migration"].items():
            if p50 is not None:
                print(f"{mode}: moved streams, break seen -> {stage}: p50 {p50:.0f} ms, p99 {p99:.0f} ms "
                      "(router histogram)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
