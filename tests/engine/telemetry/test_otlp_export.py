"""With OTEL_EXPORTER_OTLP_ENDPOINT set, spans go to that collector over OTLP/HTTP (protobuf), as the OpenTelemetry
conventions say, and not to the files. The collector here is a loopback HTTP server that decodes what it gets with
the OTLP protobuf definitions."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from engine.telemetry import tracing

pytestmark = pytest.mark.fleet  # a server that listens


@pytest.fixture
def collector():
    received: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_spans_reach_the_collector_the_environment_names(collector, monkeypatch, tmp_path):
    url, received = collector
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    exporter = tracing._exporter("router")
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("test").start_span("POST /v1/completions", attributes={tracing.REQUEST_ID: "cmpl-1"}).end()
    provider.shutdown()
    assert [path for path, _ in received] == ["/v1/traces"]
    sent = ExportTraceServiceRequest.FromString(received[0][1])
    (resource_spans,) = sent.resource_spans
    assert {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"] == "router"
    (span,) = [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert span.name == "POST /v1/completions"
    assert {a.key: a.value.string_value for a in span.attributes}[tracing.REQUEST_ID] == "cmpl-1"
    assert not (tmp_path / "traces").exists(), "with a collector, nothing goes to the files"
