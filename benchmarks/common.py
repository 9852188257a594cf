"""Helpers shared by the benchmark scripts: tables, the host's name (CPU, cores, AMX or not), the machine's
memory copy bandwidth, a PD group brought up, and concurrent streams through the openai client."""

from __future__ import annotations

import asyncio
import os
import platform
import ssl
import statistics
import time
from pathlib import Path

import openai
import torch

from engine.group.groupset import LocalGroupSet
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup


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
