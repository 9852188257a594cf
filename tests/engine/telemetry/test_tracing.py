"""Tracing in one process: the engine's phases, the ASGI span with the caller's traceparent and baggage, the file
exporter's rotation, and `tideflow trace`'s reading of span files. The trace across router, prefill and decode
processes is tests/engine/group/test_migration.py's."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from engine.main import main as engine_main
from engine.telemetry import trace_cli, tracing
from engine.telemetry.tracing import FLOW_RUN, REQUEST_ID, JsonLinesExporter, Timeline, TraceRequests, phases

MS = 1_000_000


@pytest.fixture
def spans(monkeypatch):
    """Spans of this test alone: a provider of its own, not the process's global one."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def test_a_colocated_request_passes_every_phase_in_order():
    t = Timeline(arrived=1 * MS, departed=3 * MS, scheduled=4 * MS, first_token=9 * MS, finished=20 * MS)
    assert phases(t) == [("engine.shuttle_window", 1 * MS, 3 * MS), ("engine.queue_wait", 3 * MS, 4 * MS),
                         ("engine.prefill", 4 * MS, 9 * MS), ("engine.decode", 9 * MS, 20 * MS)]


def test_prefill_ends_with_the_export_and_decode_starts_with_the_import():
    prefill = Timeline(arrived=1, departed=2, scheduled=3, first_token=5, exported=7, finished=7)
    assert [name for name, _, _ in phases(prefill)] == ["engine.shuttle_window", "engine.queue_wait", "engine.prefill",
                                                         "engine.kv_export"]
    # a decode worker: its first token came with the KV, before its first step; no prefill phase of its own
    decode = Timeline(arrived=10, imported=12, first_token=12, scheduled=13, finished=30)
    assert phases(decode) == [("engine.kv_import", 10, 12), ("engine.queue_wait", 12, 13),
                              ("engine.decode", 12, 30)]


def test_a_request_that_failed_before_its_step_has_no_step_phases():
    assert [name for name, _, _ in phases(Timeline(arrived=5, departed=6, finished=8))] == ["engine.shuttle_window"]


def _app() -> Starlette:
    async def answer(request):
        tracing.set_request_id("cmpl-test")
        tracing.engine_spans(Timeline(arrived=1 * MS, scheduled=2 * MS, first_token=3 * MS, finished=4 * MS))

        async def body():
            yield b"a"
            yield b"b"
        return StreamingResponse(body())

    async def probe(request):
        return PlainTextResponse("ok")

    return TraceRequests(Starlette(routes=[Route("/v1/completions", answer, methods=["POST"]),
                                           Route("/health", probe)]))


def _call(method: str, path: str, headers: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://member") as client:
            return await client.request(method, path, headers=headers)
    return asyncio.run(go())


def test_a_post_is_a_server_span_under_the_callers_traceparent_with_its_flow_run(spans):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    response = _call("POST", "/v1/completions", {"traceparent": parent,
                                                 "baggage": f"{tracing.FLOW_RUN_BAGGAGE}=4f0e-77"})
    assert response.text == "ab"
    done = {s.name: s for s in spans.get_finished_spans()}
    server = done["POST /v1/completions"]
    assert f"{server.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{server.parent.span_id:016x}" == "b7ad6b7169203331"
    assert server.attributes[REQUEST_ID] == "cmpl-test" and server.attributes[FLOW_RUN] == "4f0e-77"
    assert server.attributes["http.response.status_code"] == 200
    for phase in ("engine.prefill", "engine.decode"):
        assert done[phase].parent.span_id == server.context.span_id and done[phase].context.trace_id == server.context.trace_id


def test_a_served_post_ends_its_span_once(spans, caplog):
    """The SDK warns of every second end(): that was one log line per request in every router and member."""
    with caplog.at_level("WARNING", logger="opentelemetry.sdk.trace"):
        assert _call("POST", "/v1/completions", {}).text == "ab"
    assert [s.name for s in spans.get_finished_spans()].count("POST /v1/completions") == 1
    assert not [r.getMessage() for r in caplog.records if "ended span" in r.getMessage()]


def test_probes_are_not_traced(spans):
    assert _call("GET", "/health", {}).text == "ok"
    assert spans.get_finished_spans() == ()


def test_the_span_file_rotates_past_its_size(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for i in range(40):
        provider.get_tracer("t").start_span(f"s{i}").end()
    path = tmp_path / "traces" / "router-1.jsonl"
    files = JsonLinesExporter(lambda: path, max_bytes=2000)
    for span in exporter.get_finished_spans():
        files.export([span])
    old = path.with_suffix(".old.jsonl")
    assert 2000 <= old.stat().st_size < 4000  # one batch past the bound, then rotated
    assert not path.exists() or path.stat().st_size < 2000
    kept = trace_cli.read_spans(tmp_path / "traces")
    assert 0 < len(kept) < 40, "the older generations were not dropped"
    assert "s39" in {s["name"] for s in kept}, "the newest span was lost"
    provider.shutdown()


def _span(span_id: str, parent: str | None, name: str, start: int, end: int, service: str = "router", **attrs) -> dict:
    return {"trace_id": "a" * 32, "span_id": span_id, "parent_id": parent, "name": name, "kind": "server",
            "service": service, "start_ns": start, "end_ns": end, "status": "unset", "attributes": attrs, "links": []}


def test_trace_finds_a_request_by_its_id_and_prints_the_tree(tmp_path, capsys):
    folder = tmp_path / "traces"
    folder.mkdir()
    rows = [_span("1" * 16, "f" * 16, "POST /v1/completions", 0, 50 * MS),  # its parent: the client's own span
            _span("3" * 16, "2" * 16, "POST /internal/decode", 20 * MS, 49 * MS, "decode", **{REQUEST_ID: "cmpl-9"}),
            _span("2" * 16, "1" * 16, "decode /internal/decode", 19 * MS, 50 * MS)]
    (folder / "router-1.jsonl").write_text("\n".join(json.dumps(r) for r in rows[::2]) + "\n{\"cut short")
    (folder / "decode-2.jsonl").write_text(json.dumps(rows[1]) + "\n")
    spans = trace_cli.read_spans(folder)
    assert trace_cli.find_trace(spans, "cmpl-9") == "a" * 32 == trace_cli.find_trace(spans, "a" * 32)
    assert trace_cli.find_trace(spans, "cmpl-other") is None
    assert [(depth, s["name"]) for depth, s in trace_cli.timeline(spans, "a" * 32)] == [
        (0, "POST /v1/completions"), (1, "decode /internal/decode"), (2, "POST /internal/decode")]
    assert engine_main(["trace", "cmpl-9", "--dir", str(folder)], ("engine.telemetry.trace_cli",)) == 0
    printed = capsys.readouterr().out
    assert "(request cmpl-9): 3 spans, 50.0 ms" in printed and "    POST /internal/decode" in printed
    assert engine_main(["trace", "cmpl-missing", "--dir", str(folder)], ("engine.telemetry.trace_cli",)) == 1
