"""Helpers shared by the benchmark scripts: tables, the host's name (CPU, cores, AMX or not), the machine's
memory copy bandwidth, a PD group brought up, and concurrent streams through the openai client."""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import ssl
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import openai
import torch

from engine.group.groupset import LocalGroupSet
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.offline.default_model import DEFAULT_CONFIG, write_default_model


def copy_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Best-of-n large tensor copy rate (read + write bytes per second): the memory roofline."""
    src = torch.empty(mbytes * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best / 1e9


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [headers] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def host() -> str:
    """CPU model, cores and whether it has AMX (from /proc/cpuinfo's flags)."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    amx = "AMX" if any(f.startswith("amx") for f in flags) else "no AMX"
    return f"{model}, {os.cpu_count()} cores, {amx}"


def pd_group_up(gs: LocalGroupSet, model_dir: Path, engine: dict, name: str = "pd", transfer: str = "shm"):
    """A group of 1 prefill + 1 decode member on `gs`, each with `engine`'s knobs, KV moved over `transfer`, once
    it is Ready; SystemExit naming why when it fails to get there."""
    spec = InferenceGroup.model_validate({"name": name, "version": "v1", "model": {"path": str(model_dir)},
                                          "transfer": transfer,
                                          "roles": [{"role": "prefill", "engine": engine},
                                                    {"role": "decode", "engine": engine}]})
    group = gs.up(spec)
    if group.wait_for({GroupState.READY, GroupState.FAILED}, 600) != GroupState.READY:
        raise SystemExit(f"group {name} did not get ready: {group.status.events[-1].message}")
    return group


async def run_streams(url: str, key: str, n: int, prompt_len: int, out_tokens: int, seed: int,
                      verify: ssl.SSLContext | bool = True) -> tuple[float, float]:
    """(output tokens/s over n concurrent streams through the openai client, TTFT p50 in ms); `verify`: what the
    client trusts on an https `url`."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600,
                                http_client=openai.DefaultAsyncHttpxClient(verify=verify, trust_env=False))

    async def one(i: int) -> tuple[int, float]:
        t0, first, tokens = time.perf_counter(), None, 0
        prompt = " ".join(f"w{(seed * 7919 + i * 31 + j) % 997}" for j in range(prompt_len))
        stream = await client.completions.create(model="default", prompt=prompt, max_tokens=out_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, (first or time.perf_counter()) - t0

    try:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return sum(t for t, _ in done) / wall, statistics.median(f for _, f in done) * 1000


def stream_rounds(gs: LocalGroupSet, args: argparse.Namespace, seed: int,
                  verify: ssl.SSLContext | bool = True) -> tuple[float, float]:
    """A warm-up, then `args.rounds` runs of `args.streams` streams on `gs`'s router: (tok/s, TTFT p50 ms), each the
    median of the rounds."""
    asyncio.run(run_streams(gs.url, gs.client_key, 4, args.prompt_len, 8, seed + 1, verify))
    runs = [asyncio.run(run_streams(gs.url, gs.client_key, args.streams, args.prompt_len, args.output_len,
                                    seed * 100 + i, verify)) for i in range(args.rounds)]
    return statistics.median(r for r, _ in runs), statistics.median(t for _, t in runs)


def on_off_flags(description: str) -> argparse.Namespace:
    """The flags of a benchmark that compares fleets with one setting on and off (tracing, TLS)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="words per prompt")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="fleets per mode, alternating on and off")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs of the streams per fleet (their median)")
    return ap.parse_args()


def compare_on_off(what: str, args: argparse.Namespace, fleet_run: Callable[..., tuple], setting: str,
                   extra_headers: tuple[str, ...] = ()) -> None:
    """`args.repeats` fleets per mode, alternating on/off so drift of the machine hits both alike; prints each
    fleet, a table and the medians' ratio on/off. `fleet_run(model_dir, home, on, args, seed)` gives (tok/s,
    TTFT p50 ms, *one figure per extra header)."""
    rows, figures = [], {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG, seed=0)
        for r in range(args.repeats):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                rate, ttft, *extra = fleet_run(model_dir, Path(tmp) / f"home-{r}-{on}", on, args, r)
                figures[on].append((rate, ttft))
                rows.append([r, "on" if on else "off", f"{rate:.0f}", f"{ttft:.0f}", *extra])
                shown = "".join(f", {value} {header}" for value, header in zip(extra, extra_headers))
                print(f"run {r} {what} {'on' if on else 'off'}: {rate:.0f} tok/s, TTFT p50 {ttft:.0f} ms{shown}",
                      flush=True)
    print(f"\n{host()}; default model, float32, {setting}, {args.streams} streams, {args.prompt_len} words in / "
          f"{args.output_len} tokens out, greedy")
    print_table(["run", what, "tok/s", "TTFT p50 ms", *extra_headers], rows)
    on_rate, off_rate = (statistics.median(r for r, _ in figures[m]) for m in (True, False))
    on_ttft, off_ttft = (statistics.median(t for _, t in figures[m]) for m in (True, False))
    print(f"\nmedians: on {on_rate:.0f} tok/s, off {off_rate:.0f} tok/s: throughput on/off {on_rate / off_rate:.3f} "
          f"(cost {100 * (1 - on_rate / off_rate):+.1f} %); TTFT p50 on/off {on_ttft / off_ttft:.3f}")
