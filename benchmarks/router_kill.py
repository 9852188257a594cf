"""A router SIGKILL under load, one router vs two replicas sharing the port, in one run: what clients see.

For each mode a `tideflow controller` (its own process, its own home) runs `--router-replicas 1` (the
baseline: one router, as before replicas) or 2, with one colocated group. Then, through the official
openai client:
  - `--streams` long streams and `--calls` long non-streamed requests are put in flight (the non-streamed
    ones with the openai client's default retries, 2), and one router replica is SIGKILLed through the
    controller's fault API;
  - right after the kill, `--after` new requests (half streamed) from a client with retries off.
Per mode it prints: streams cut, non-streamed requests failed and retried (a retry is a second HTTP
request of one call, counted on the wire), new requests failed, and how long until the controller had
the killed replica running again.

    python benchmarks/router_kill.py              # the 2-layer test model
    python benchmarks/router_kill.py --default    # the default model (~115M parameters)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model  # noqa: E402
from engine.group.manager import GroupState  # noqa: E402
from engine.group.spec import InferenceGroup  # noqa: E402
from engine.runtime.process import free_port, start_service, tideflow_argv  # noqa: E402

MAX_TOKENS = 400


def group(model_dir: Path) -> InferenceGroup:
    return InferenceGroup.model_validate({
        "name": "bench-rk", "version": "v1", "model": {"path": str(model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 64 << 20, "max_wait_ms": 0}}]})


async def stream(client: openai.AsyncOpenAI, i: int) -> str:
    try:
        s = await client.completions.create(model="default", prompt=f"stream {i}", max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for _ in s:
            pass
        return "ok"
    except openai.APIError as exc:
        return type(exc).__name__


async def call(client: openai.AsyncOpenAI, i: int) -> str:
    try:
        await client.completions.create(model="default", prompt=f"call {i}", max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True}, extra_headers={"x-bench-call": str(i)})
        return "ok"
    except openai.APIError as exc:
        return type(exc).__name__


async def new_request(client: openai.AsyncOpenAI, i: int) -> str:
    try:
        if i % 2:
            s = await client.completions.create(model="default", prompt=f"after {i}", max_tokens=8, stream=True)
            async for _ in s:
                pass
        else:
            await client.completions.create(model="default", prompt=f"after {i}", max_tokens=8)
        return "ok"
    except openai.APIError as exc:
        return type(exc).__name__


async def drill(controller, router_url: str, key: str, args: argparse.Namespace) -> dict:
    sent = Counter()

    async def count(request: httpx.Request) -> None:
        if "x-bench-call" in request.headers:
            sent[request.headers["x-bench-call"]] += 1

    base = f"{router_url}/v1"
    retrying = openai.AsyncOpenAI(base_url=base, api_key=key, timeout=120,  # the openai default: 2 retries
                                  http_client=httpx.AsyncClient(event_hooks={"request": [count]}, timeout=120))
    plain = openai.AsyncOpenAI(base_url=base, api_key=key, timeout=120, max_retries=0)
    streams = [asyncio.create_task(stream(plain, i)) for i in range(args.streams)]
    calls = [asyncio.create_task(call(retrying, i)) for i in range(args.calls)]
    await asyncio.sleep(args.kill_after_s)
    before = controller.status().router_pids
    killed = await asyncio.to_thread(controller.kill_router)
    t_kill = time.monotonic()
    after = await asyncio.gather(*(new_request(plain, i) for i in range(args.after)))
    back_s = None
    while time.monotonic() - t_kill < 120:
        pids = controller.status().router_pids
        if len(pids) >= len(before) and not set(pids) <= set(before) - {int(killed.id.split()[1].rstrip(","))}:
            back_s = time.monotonic() - t_kill
            break
        await asyncio.sleep(0.1)
    s, c = await asyncio.gather(*streams), await asyncio.gather(*calls)
    await retrying.close()
    await plain.close()
    return {"replicas": len(before), "streams cut": f"{sum(r != 'ok' for r in s)}/{len(s)}",
            "calls failed": f"{sum(r != 'ok' for r in c)}/{len(c)}",
            "calls retried": sum(n > 1 for n in sent.values()),
            "new failed": f"{sum(r != 'ok' for r in after)}/{len(after)}",
            "replica back s": None if back_s is None else round(back_s, 1),
            "reasons": dict(Counter(r for r in [*s, *c, *after] if r != "ok"))}


def run_mode(replicas: int, model_dir: Path, args: argparse.Namespace) -> dict:
    from engine.control import discovery
    from engine.control.client import ControlClient

    home = Path(tempfile.mkdtemp(prefix=f"tideflow-rk{replicas}-"))
    os.environ["TIDEFLOW_HOME"] = str(home)
    port = free_port()
    ctl = start_service("controller", tideflow_argv("controller", "--port", str(port), "--router-replicas",
                                                     str(replicas), "--model-dir", str(model_dir)),
                        home / "controller.log", f"http://127.0.0.1:{port}/health", timeout_s=120)
    try:
        with ControlClient.connect() as controller:
            controller.apply(group(model_dir))
            view = controller.wait_for("bench-rk", {GroupState.READY, GroupState.FAILED}, 300)
            if view.state != GroupState.READY:
                raise SystemExit(f"the group did not start: {view.message}")
            try:
                return asyncio.run(drill(controller, controller.status().router_url, discovery.router_key(), args))
            finally:
                controller.down()
    finally:
        ctl.stop(grace_s=120)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the default model instead of the 2-layer test model")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--after", type=int, default=12)
    ap.add_argument("--kill-after-s", type=float, default=1.0)
    args = ap.parse_args()
    model_dir = Path(tempfile.mkdtemp(prefix="tideflow-rk-model-"))
    write_default_model(model_dir, DEFAULT_CONFIG if args.default else TINY_CONFIG)
    try:
        rows = [run_mode(n, model_dir, args) for n in (1, 2)]
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(f"router SIGKILL under load on {host()}: {args.streams} streams + {args.calls} non-streamed calls in "
          f"flight, {args.after} new requests right after ({'default' if args.default else 'tiny'} model)")
    headers = list(rows[0])
    print_table(headers, [[row[h] for h in headers] for row in rows])


if __name__ == "__main__":
    main()
