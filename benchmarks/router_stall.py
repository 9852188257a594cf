"""Does one client's huge prompt stall the router for everybody else? The router's /health latency, probed every
50 ms, while 4 clients at once send a ~7 MB prompt, then 10^5 chat messages, then the most messages a body may
carry (MAX_MESSAGES) filled up to the router's character bound, to a prefill + decode group (issue
#37: no probe slower than 100 ms). The baseline, in the same run: the same probes with no big request.

    python benchmarks/router_stall.py [--concurrent 4] [--prompt-mb 7] [--messages 100000] [--period-ms 50]
                                      [--target-ms 100] [--tiny] [--target member]

`--target member`: the same cases against one `tideflow serve` member taking clients itself (its /health), which
refuses a prompt too long for any tokenization before tokenizing it, as the router does.

A LocalGroupSet starts `tideflow router` as a user starts it (its CLI, its defaults) and a 1P+1D group of real
members of the default model. A PD group is what makes the router tokenize: a colocated group gets the body
as it came. All big bodies stay under the router's 8 MiB body limit, so they reach its prompt path: body parse
and the context check (the 7 MB prompt), the message-count bound (10^5 short messages), templating and
tokenizing too (MAX_MESSAGES messages: fewer characters than the check's bound). Each probe starts on its own 50 ms tick, not after the previous one returned, so a
stall shows in every probe it delays. Printed per case: the probes, their p50 / p99 / max latency, what the
big requests got, and PASS when no probe took longer than the target.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, pd_group_up, print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model  # noqa: E402
from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok  # noqa: E402
from engine.model.loader import read_config  # noqa: E402
from engine.api.protocol import MAX_MESSAGES  # noqa: E402
from engine.api.requests import prompt_char_limit  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402

MEMBER_KEY = "router-stall-client"


async def probe(client: httpx.AsyncClient, latencies: list[float], errors: list[str]) -> None:
    t0 = time.perf_counter()
    try:
        r = await client.get("/health")
        if r.status_code != 200:
            errors.append(f"/health answered {r.status_code}")
    except httpx.HTTPError as exc:
        errors.append(f"/health: {type(exc).__name__}")
    latencies.append(time.perf_counter() - t0)


async def big(client: httpx.AsyncClient, path: str, content: bytes) -> tuple[int, str, str]:
    """Status, error code and message of one big request (its answer, if one came)."""
    try:
        r = await client.post(path, content=content, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return 0, type(exc).__name__, str(exc)
    if r.status_code == 200:
        return 200, "", ""
    try:
        error = r.json()["error"]
        return r.status_code, error.get("code") or "", error.get("message") or ""
    except (ValueError, KeyError, TypeError):
        return r.status_code, "", r.text[:200]


async def measure(url: str, key: str, path: str | None, content: bytes, args) -> tuple[list[float], list[str], list]:
    """Probe /health every period from `--lead-s` before the big requests until `--lead-s` after the last ends
    (or for `--idle-s` when `path` is None)."""
    latencies: list[float] = []
    errors: list[str] = []
    answers: list = []
    timeout = httpx.Timeout(args.timeout_s)
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=timeout) as prober, \
            httpx.AsyncClient(base_url=url, trust_env=False, timeout=timeout,
                              headers={"authorization": f"Bearer {key}"}) as sender:
        await prober.get("/health")  # the probes' connection is open before the first one is timed
        stop = asyncio.Event()
        probes: list[asyncio.Task] = []

        async def ticks() -> None:
            period, start = args.period_ms / 1000, time.perf_counter()
            n = 0
            while not stop.is_set():
                probes.append(asyncio.create_task(probe(prober, latencies, errors)))
                n += 1
                await asyncio.sleep(max(0.0, start + n * period - time.perf_counter()))

        ticker = asyncio.create_task(ticks())
        try:
            if path is None:
                await asyncio.sleep(args.idle_s)
            else:
                await asyncio.sleep(args.lead_s)
                answers = await asyncio.gather(*(big(sender, path, content) for _ in range(args.concurrent)))
                await asyncio.sleep(args.lead_s)
        finally:
            stop.set()
            await ticker
            await asyncio.gather(*probes)
    return latencies, errors, answers


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bodies(args, max_chars: int) -> list[tuple[str, str | None, bytes]]:
    """(case, path, body) per case; the bodies are encoded before any probe runs. The last is the worst a
    client can still make the router template and tokenize: MAX_MESSAGES messages whose characters all but
    reach the router's bound (`max_chars`)."""
    prompt = "word " * (args.prompt_mb * 1_000_000 // 5)
    messages = [{"role": "user", "content": args.message}] * args.messages
    full = [{"role": "user", "content": "w " * (max_chars // MAX_MESSAGES // 2)}] * MAX_MESSAGES
    return [
        ("no big request", None, b""),
        (f"{args.prompt_mb} MB prompt", "/v1/completions",
         json.dumps({"model": "default", "prompt": prompt, "max_tokens": 16}).encode()),
        (f"{args.messages:,} chat messages", "/v1/chat/completions",
         json.dumps({"model": "default", "messages": messages, "max_tokens": 16}).encode()),
        (f"{MAX_MESSAGES:,} messages of {len(full[0]['content'])} characters", "/v1/chat/completions",
         json.dumps({"model": "default", "messages": full, "max_tokens": 16}).encode()),
    ]


@contextlib.contextmanager
def serving(args, model_dir: Path, tmp: Path) -> Iterator[tuple[str, str, str]]:
    """(URL, client key, what) of the server under test: `tideflow router` in front of a 1P+1D group (what makes
    the router tokenize), or one `tideflow serve` member taking clients itself (`--target member`)."""
    if args.target == "member":
        port = free_port()
        child = Child("serve", tideflow_argv("serve", "--model", str(model_dir), "--port", str(port),
                                             "--served-model-name", "default", "--kv-cache-bytes", str(64 << 20)),
                      tmp / "serve.log", {"TIDEFLOW_API_KEYS": MEMBER_KEY})
        try:
            if not wait_http_ok(f"http://127.0.0.1:{port}/ready", 600, child):
                raise SystemExit(f"tideflow serve did not get ready: {child.log_tail()}")
            yield f"http://127.0.0.1:{port}", MEMBER_KEY, "member: `tideflow serve` defaults"
        finally:
            child.stop()
        return
    with LocalGroupSet(GroupSetConfig(model_dir=model_dir)) as gs:
        pd_group_up(gs, model_dir, {"kv_cache_bytes": 64 << 20})
        if not wait_http_ok(gs.url + "/ready", 60):
            raise SystemExit(f"the router at {gs.url} never had the group routable")
        yield gs.url, gs.client_key, "router: `tideflow router` defaults, 1P+1D group"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrent", type=int, default=4, help="big requests sent at once, per case")
    ap.add_argument("--prompt-mb", type=int, default=7, help="size of the big text prompt, in MB")
    ap.add_argument("--messages", type=int, default=100_000, help="messages of the big chat request")
    ap.add_argument("--message", default="hi", help="the content of each of those messages")
    ap.add_argument("--period-ms", type=float, default=50.0, help="one /health probe every this often")
    ap.add_argument("--target-ms", type=float, default=100.0, help="PASS: no probe slower than this")
    ap.add_argument("--lead-s", type=float, default=0.5, help="probing before the big requests and after them")
    ap.add_argument("--idle-s", type=float, default=3.0, help="probing with no big request (the baseline)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per request, probes included")
    ap.add_argument("--tiny", action="store_true", help="the 2-layer test model (a 512-entry vocabulary)")
    ap.add_argument("--target", choices=["router", "member"], default="router",
                    help="probe the router (in front of a PD group) or one member taking clients itself")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its fleet

    rows, refusals = [], []
    with tempfile.TemporaryDirectory(prefix="tideflow-router-stall-") as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        config = TINY_CONFIG if args.tiny else DEFAULT_CONFIG
        model_dir = write_default_model(Path(tmp) / "model", config, seed=0)
        cases = bodies(args, prompt_char_limit(Tokenizer(model_dir), read_config(model_dir).context_length))
        with serving(args, model_dir, Path(tmp)) as (url, key, what):
            for case, path, content in cases:
                latencies, errors, answers = asyncio.run(measure(url, key, path, content, args))
                worst = max(latencies)
                ok = not errors and worst * 1000 <= args.target_ms
                got = Counter(f"{status} {code}".strip() for status, code, _ in answers)
                refusals += [f"{case}: {status} {message}" for status, _, message in answers[:1] if status != 200]
                rows.append([case, f"{len(content) / 1e6:.1f} MB x {args.concurrent}" if path else "-",
                             ", ".join(f"{k} x{n}" for k, n in got.items()) or "-", len(latencies),
                             f"{pct(latencies, 0.5) * 1000:.1f}", f"{pct(latencies, 0.99) * 1000:.1f}",
                             f"{worst * 1000:.1f}", "PASS" if ok else "FAIL"])
                print(f"{case}: done{'; ' + errors[0] if errors else ''}", file=sys.stderr, flush=True)
    print(f"host: {host()}; {what} of the {'tiny' if args.tiny else 'default'} model; /health every "
          f"{args.period_ms:g} ms")
    print_table(["case", "big requests", "answers", "probes", "p50 ms", "p99 ms", "max ms",
                 f"max <= {args.target_ms:g} ms"], rows)
    for line in refusals:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
