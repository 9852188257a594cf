"""Open-loop load generator against any OpenAI-compatible server: arrivals follow the clock, never the completions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

import httpx
import openai
from pydantic import BaseModel, Field
from tqdm import tqdm

from drills.results import LoadDrillReport, RequestRecord, capacity_watermark, summarize_step
from drills.spec import LoadDrillSpec
from drills.workload import PlannedRequest, build_schedule
from engine.runtime.http import bearer_async_client
from engine.telemetry.tracing import FLOW_RUN_BAGGAGE


class DrillProgress(BaseModel):
    """Passed to the progress callback after every finished (or dropped) request."""

    total: int = Field(ge=0, description="requests in the whole schedule")
    done: int = Field(ge=0, description="requests finished, ok or error")
    ok: int = Field(ge=0)
    error: int = Field(ge=0)
    step: int = Field(ge=0, description="step of the request that just finished")


ProgressCallback = Callable[[DrillProgress], None]


def _error_reason(e: BaseException, timeout_s: float) -> str:
    if isinstance(e, (asyncio.TimeoutError, openai.APITimeoutError)):
        return f"timeout after {timeout_s:g}s"
    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        detail = inner.get("message") or inner.get("detail") or e.message
        return f"http {e.status_code}: {str(detail)[:200]}"
    if isinstance(e, openai.APIConnectionError):
        return f"connection: {str(e.__cause__ or e)[:200]}"
    return f"{type(e).__name__}: {str(e)[:200]}"


async def _stream(client: openai.AsyncOpenAI, spec: LoadDrillSpec, req: PlannedRequest) -> dict:
    """Send one streaming request; return its chunk timings and usage."""
    common = {"model": spec.model, "max_tokens": req.max_tokens, "stream": True,
              "stream_options": {"include_usage": True},
              "extra_body": {"ignore_eos": True} if spec.ignore_eos else None}
    if spec.temperature is not None:
        common["temperature"] = spec.temperature
    if spec.endpoint == "chat":
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": req.prompt}], **common)
    else:
        stream = await client.completions.create(prompt=req.prompt, **common)
    first = last = None
    gaps: list[float] = []
    chunks: list[str] = []
    usage = None
    async for chunk in stream:
        now = time.perf_counter()
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text = choice.delta.content if spec.endpoint == "chat" else choice.text
        if not text:
            continue
        if first is None:
            first = now
        else:
            gaps.append((now - last) * 1000)
        last = now
        chunks.append(text)
    return {"first": first, "end": time.perf_counter(), "gaps": gaps, "chunks": chunks, "usage": usage}


async def _send(client: openai.AsyncOpenAI, spec: LoadDrillSpec, req: PlannedRequest, t0: float) -> RequestRecord:
    start = time.perf_counter()
    base = {"step": req.step, "index": req.index, "scheduled_s": req.arrival_s, "sent_s": start - t0,
            "prompt_tokens": req.prompt_tokens, "max_tokens": req.max_tokens, "prompt": req.prompt}
    try:
        r = await asyncio.wait_for(_stream(client, spec, req), spec.request_timeout_s)
    except Exception as e:  # every failure becomes a counted error with its reason, never a lost request
        return RequestRecord(**base, end_s=time.perf_counter() - t0, ok=False, output_tokens=0,
                             error=_error_reason(e, spec.request_timeout_s))
    usage = r["usage"]
    if usage is not None:
        base["prompt_tokens"] = usage.prompt_tokens
    n = usage.completion_tokens if usage is not None else len(r["chunks"])
    end_s = r["end"] - t0
    if r["first"] is None:
        return RequestRecord(**base, end_s=end_s, ok=False, output_tokens=n, error="stream ended without text",
                             chunks=r["chunks"])
    e2e = (r["end"] - start) * 1000
    ttft = (r["first"] - start) * 1000
    return RequestRecord(
        **base, end_s=end_s, ok=True, output_tokens=n, ttft_ms=ttft, e2e_ms=e2e,
        tpot_ms=(e2e - ttft) / (n - 1) if n > 1 else None,
        itl_ms=sum(r["gaps"]) / len(r["gaps"]) if r["gaps"] else None, itl_gaps_ms=r["gaps"],
        max_gap_ms=max(r["gaps"], default=None), chunks=r["chunks"],
    )


def _client(spec: LoadDrillSpec) -> openai.AsyncOpenAI:
    # The connection pool is as large as the in-flight cap: a smaller pool would queue requests inside httpx,
    # turning the open loop into a hidden closed one.
    limits = httpx.Limits(max_connections=spec.max_in_flight, max_keepalive_connections=spec.max_in_flight)
    http = bearer_async_client(None, timeout_s=spec.request_timeout_s, limits=limits)  # openai adds the key
    key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
    baggage = {"baggage": f"{FLOW_RUN_BAGGAGE}={spec.flow_run_id}"} if spec.flow_run_id else None
    return openai.AsyncOpenAI(base_url=spec.base_url, api_key=key or "none", max_retries=0,
                              timeout=spec.request_timeout_s, http_client=http, default_headers=baggage)


async def replay(spec: LoadDrillSpec, records: list[RequestRecord]) -> list[list[str] | None]:
    """The same requests sent again, one at a time (undisturbed): their text chunks (None where one failed)."""
    async with _client(spec) as client:
        out: list[list[str] | None] = []
        for rec in records:
            req = PlannedRequest(rec.step, rec.index, rec.scheduled_s, rec.prompt, rec.prompt_tokens, rec.max_tokens)
            try:
                out.append((await asyncio.wait_for(_stream(client, spec, req), spec.request_timeout_s))["chunks"])
            except Exception:  # counted by the caller as an answer that could not be checked
                out.append(None)
        return out


@dataclass
class Driven:
    """What `drive` did. `issued` is counted before each request leaves (its own counter, never derived from
    the records), so a request that vanished without a record shows as issued != ok + error + open."""

    records: list[RequestRecord]
    issued: int
    still_open: int
    started: float


async def drive(spec: LoadDrillSpec, plan: list[PlannedRequest], on_done: Callable[[RequestRecord], None],
                stop: threading.Event | None = None, flowing: threading.Event | None = None) -> Driven:
    """Send `plan` on its clock (or until `stop` is set: later arrivals are not sent); `flowing` is set
    once the first request has left."""
    records: list[RequestRecord] = []
    pending: set[asyncio.Task] = set()
    issued = 0

    def finish(rec: RequestRecord) -> None:
        records.append(rec)
        on_done(rec)

    async with _client(spec) as client:
        started = time.time()
        t0 = time.perf_counter()
        for req in plan:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if stop is not None and stop.is_set():
                break
            issued += 1
            if len(pending) >= spec.max_in_flight:
                now = time.perf_counter() - t0
                finish(RequestRecord(step=req.step, index=req.index, scheduled_s=req.arrival_s, sent_s=now,
                                     end_s=now, ok=False, error=f"dropped: {spec.max_in_flight} requests in flight",
                                     prompt_tokens=req.prompt_tokens, output_tokens=0, max_tokens=req.max_tokens))
                continue
            task = asyncio.create_task(_send(client, spec, req, t0))
            pending.add(task)
            if flowing is not None:
                flowing.set()
            task.add_done_callback(lambda t: (pending.discard(t), finish(t.result())))
        while pending:
            await asyncio.wait(set(pending))
    return Driven(sorted(records, key=lambda r: r.index), issued, len(pending), started)


async def run_load_drill_async(spec: LoadDrillSpec, progress: ProgressCallback | None = None,
                               stop: threading.Event | None = None,
                               flowing: threading.Event | None = None) -> LoadDrillReport:
    """The drill: schedule, drive, summarise per step, find the watermark, then write and validate the reports.

    Setting `stop` ends the arrivals early (background traffic); the report covers what was sent. `flowing`
    is set when the first request leaves (a fault drill times its kill from there)."""
    plan, rates = build_schedule(spec)
    counts = {"ok": 0, "error": 0}
    bar = tqdm(total=len(plan), desc="load drill", unit="req", file=sys.stderr, disable=not spec.progress_bar)

    def on_done(rec: RequestRecord) -> None:
        counts["ok" if rec.ok else "error"] += 1
        bar.update(1)
        bar.set_postfix(ok=counts["ok"], error=counts["error"], step=rec.step, refresh=False)
        if progress is not None:
            progress(DrillProgress(total=len(plan), done=counts["ok"] + counts["error"], step=rec.step, **counts))

    try:
        driven = await drive(spec, plan, on_done, stop, flowing)
    finally:
        bar.close()
    records, started = driven.records, driven.started
    plan = plan[: driven.issued]
    steps = [summarize_step(k, rate, sum(p.step == k for p in plan), [r for r in records if r.step == k], spec)
             for k, rate in enumerate(rates)]
    top = capacity_watermark(steps)
    report = LoadDrillReport(
        spec=spec, started_at=datetime.fromtimestamp(started, timezone.utc).isoformat(), steps=steps,
        capacity_rps=top.offered_rate if top else None, capacity_step=top.step if top else None,
        sent=driven.issued, ok=sum(r.ok for r in records), error=sum(not r.ok for r in records),
        still_open=driven.still_open, requests=records,
    )
    if spec.expectations_suite is not None:
        from drills.expectations import DEFAULT_SUITE, validate_steps

        suite = DEFAULT_SUITE if spec.expectations_suite == "packaged" else spec.expectations_suite
        report.expectations = validate_steps(report, suite)
    if spec.out_dir is not None:
        from drills.report import write_report

        report.files = write_report(report, spec.out_dir)
    return report


def run_load_drill(spec: LoadDrillSpec, progress: ProgressCallback | None = None,
                   stop: threading.Event | None = None) -> LoadDrillReport:
    """Blocking entry point (for the Prefect task and the CLI): runs the drill on a fresh event loop."""
    return asyncio.run(run_load_drill_async(spec, progress, stop))
