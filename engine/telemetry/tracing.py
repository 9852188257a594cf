"""OpenTelemetry traces of the request path: one trace per request, across the router and every member it touches.

Each process calls `setup(service)` once. Spans go to an OTLP/HTTP collector when `OTEL_EXPORTER_OTLP_ENDPOINT`
(or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, as the OpenTelemetry conventions say, and otherwise to a JSON-lines
file of this process in `$TIDEFLOW_HOME/traces/` (`tideflow trace` reads those). `OTEL_SDK_DISABLED=true` turns
tracing off; `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` choose the sampler (the SDK reads them; the default
follows the caller's sampling decision and samples every new trace). W3C `traceparent` and `baggage` come in with a
request and go out with every call it makes (`TraceRequests`, `inject`).

The engine thread never touches OpenTelemetry: it stamps a request's times (`Timeline`) and the API layer turns them
into spans when the request ends (`engine_spans`), so tracing costs the step loop nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

from opentelemetry import baggage, context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from engine.runtime.paths import home

TRACER_NAME = "tideflow"
REQUEST_ID = "tideflow.request_id"  # the id a client sees in its answer (cmpl-..., chatcmpl-...)
FLOW_RUN_BAGGAGE = "prefect.flow_run_id"  # a drill or canary run puts it in the baggage of what it sends
FLOW_RUN = "tideflow.flow_run_id"
FILE_MAX_BYTES_ENV, FILE_MAX_BYTES = "TIDEFLOW_TRACE_FILE_MAX_BYTES", 64 << 20  # per process, before it rotates
BATCH_DELAY_MS = 1000  # spans reach their file (or collector) within this; OTEL_BSP_SCHEDULE_DELAY overrides it
TRACED_METHODS = frozenset({"POST"})  # the request path; probes, scrapes and reads stay out of the traces
# FastAPI 0.150 on traces every request by itself once a tracer provider is set: probes and scrapes too, and a span
# per dependency. TraceRequests traces the request path alone, the same on every FastAPI version: pass this as
# FastAPI(telemetry=...) (an older FastAPI keeps it as an unused extra).
FASTAPI_OWN_TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
_setup_lock = threading.Lock()
_service: str | None = None


def traces_dir() -> Path:
    return home() / "traces"


def enabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def setup(service: str, group: str = "", version: str = "") -> None:
    """Install this process's tracer provider (once; later calls keep the first). A no-op when tracing is off.
    `service`: router, colocated, prefill, decode or encoder; `group` and `version` name the member's group."""
    global _service
    with _setup_lock:
        if _service is not None or not enabled():
            return
        _service = service
        attributes = {"service.name": service, "process.pid": os.getpid()}
        attributes.update({k: v for k, v in (("tideflow.group", group), ("tideflow.version", version)) if v})
        provider = TracerProvider(resource=Resource.create(attributes))
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else BATCH_DELAY_MS  # None: the SDK reads it
        provider.add_span_processor(BatchSpanProcessor(_exporter(service), schedule_delay_millis=delay))
        trace.set_tracer_provider(provider)


def _exporter(service: str) -> SpanExporter:
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint, headers, timeout and compression from the OTEL_EXPORTER_OTLP_* variables
    return JsonLinesExporter(lambda: traces_dir() / f"{service}-{os.getpid()}.jsonl")


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (before a process leaves on purpose, or a test reads the files)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_ms)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


class JsonLinesExporter(SpanExporter):
    """One JSON object per span, appended to a file of this process alone (the batch processor's one thread writes
    it), so readers never see two writers' lines interleaved. Past `max_bytes` the file becomes `<name>.old.jsonl`
    (replacing the one before) and a new one starts: a process keeps at most twice that on disk. `path` is asked
    at each export: the file follows $TIDEFLOW_HOME should it change (a test process runs many homes)."""

    def __init__(self, path: Callable[[], Path], max_bytes: int | None = None) -> None:
        self.path = path
        self.max_bytes = max_bytes if max_bytes is not None else int(os.environ.get(FILE_MAX_BYTES_ENV, FILE_MAX_BYTES))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        path = self.path()
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(path.parent, 0o700)  # no prompt is in a span, but request ids and key digests are
            with open(path, "a", encoding="utf-8") as out:
                out.writelines(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
                full = out.tell() >= self.max_bytes
            if full:
                os.replace(path, path.with_suffix(".old.jsonl"))
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict:
    """What the file exporter writes of a span (ids in the W3C hex form)."""
    ctx = span.get_span_context()
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "name": span.name, "kind": span.kind.name.lower(),
        "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time, "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
    }


# ---- across processes ------------------------------------------------------------------------------------------
def inject(headers: dict[str, str], span: trace.Span | None = None) -> dict[str, str]:
    """`headers` with the W3C traceparent (of `span`, else of the current span) and the current baggage."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(headers, context=ctx)
    return headers


class TraceRequests:
    """ASGI middleware: a SERVER span around each POST, child of the caller's `traceparent`, current while the
    handler runs and open until the last byte of its answer (a stream's too). Its flow-run baggage, when a drill or
    a canary sent it, is recorded on the span."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in TRACED_METHODS or not enabled():
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate", b"baggage")}
        parent = propagate.extract(carrier)
        span = tracer().start_span(f"{scope['method']} {scope['path']}", context=parent,
                                   kind=SpanKind.SERVER, attributes={"http.request.method": scope["method"],
                                                                    "url.path": scope["path"]})
        flow_run = baggage.get_baggage(FLOW_RUN_BAGGAGE, parent)
        if flow_run:
            span.set_attribute(FLOW_RUN, str(flow_run))
        token = context.attach(trace.set_span_in_context(span, parent))
        answered = False  # the answer's last byte ended the span (the SDK warns of a second end)

        async def traced_send(message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
                span.end()

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            context.detach(token)
            if not answered:
                span.end()


def client_span(name: str, attributes: dict | None = None, links: Iterable[trace.SpanContext] = ()) -> trace.Span:
    """A CLIENT span under the current one (a call to another process); the caller ends it."""
    return tracer().start_span(name, kind=SpanKind.CLIENT, attributes=attributes,
                               links=[Link(c) for c in links if c.is_valid])


def set_request_id(request_id: str) -> None:
    """Name the current request by the id its client sees (`tideflow trace <id>` finds it by that)."""
    trace.get_current_span().set_attribute(REQUEST_ID, request_id)


# ---- the engine's times, as spans ------------------------------------------------------------------------------
class Timeline(NamedTuple):
    """When one request passed each point in an engine, in wall-clock nanoseconds (0: it did not pass it).

    arrived: submitted to the engine; departed: left the shuttle window; imported: its KV, pulled from prefill, is
    in this decode worker's blocks; scheduled: its first step began; first_token: its first token was sampled;
    exported: its KV is staged for decode (a prefill worker); finished: it left the engine."""

    arrived: int = 0
    departed: int = 0
    imported: int = 0
    scheduled: int = 0
    first_token: int = 0
    exported: int = 0
    finished: int = 0


def wall_ns(monotonic_s: float | None) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (spans of different processes line up by wall clock)."""
    if monotonic_s is None:
        return 0
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def phases(timeline: Timeline) -> list[tuple[str, int, int]]:
    """(span name, start, end) of each phase the request passed, in order."""
    t = timeline
    queued_from = t.departed or t.imported or t.arrived
    found = [("engine.shuttle_window", t.arrived, t.departed), ("engine.kv_import", t.arrived, t.imported),
             ("engine.queue_wait", queued_from, t.scheduled), ("engine.prefill", t.scheduled, t.first_token)]
    if t.exported:
        found.append(("engine.kv_export", t.first_token, t.exported))
    else:
        found.append(("engine.decode", t.first_token, t.finished))
    return [(name, start, end) for name, start, end in found if start and end and end >= start]


def engine_spans(timeline: Timeline | None) -> None:
    """Children of the current span for each phase the request passed in the engine: none when tracing is off or the
    request's trace is not sampled. The current span may have ended already (its answer went out first)."""
    parent = trace.get_current_span().get_span_context()
    if timeline is None or not (parent.is_valid and parent.trace_flags.sampled):
        return
    for name, start, end in phases(timeline):
        tracer().start_span(name, start_time=start).end(end_time=end)
