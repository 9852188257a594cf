"""Bounded reads as every tideflow server runs them (engine.api.connections + BodyLimit): a slow head is a 408,
a stalled body a 408, one address past its connection cap a 503; a kept-alive connection that idles is not
answered anything it did not ask for. A real uvicorn server on loopback with the bounded protocol."""

from __future__ import annotations

import socket

import pytest
from fastapi import FastAPI, Request

from engine.api.connection_limits import ConnectionLimits
from engine.api.connections import bounded_protocol
from engine.api.errors import install_error_handlers
from engine.api.inproc import serve_in_thread
from engine.api.limits import BodyLimit

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

HEAD_S = 0.3


def app_with_limits(body_timeout_s: float) -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=1 << 20, read_timeout_s=body_timeout_s)
    install_error_handlers(app)

    @app.get("/ping")
    async def ping():
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture
def server():
    limits = ConnectionLimits(header_timeout_s=HEAD_S, body_timeout_s=HEAD_S, max_connections_per_address=3)
    with serve_in_thread(app_with_limits(HEAD_S), http=bounded_protocol(limits), timeout_keep_alive=30) as url:
        yield int(url.rsplit(":", 1)[1])


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def read_response(s: socket.socket) -> bytes:
    """One whole response (head and Content-Length body): a recv may return it in pieces."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket's timeout)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_head_that_does_not_come_in_time_is_a_408_and_closed(server):
    with connect(server) as s:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"no request head within" in answer


def test_a_body_that_stalls_is_a_408(server):
    with connect(server) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        answer = read_response(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"request body stalled" in answer


def test_one_address_past_its_connection_cap_is_a_503_and_the_others_are_served(server):
    held = [connect(server) for _ in range(3)]
    try:
        for s in held:  # each a live connection with a request answered and kept alive
            s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(s).startswith(b"HTTP/1.1 200")
        with connect(server) as extra:
            answer = read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b"holds 3 connections" in answer
    finally:
        for s in held:
            s.close()
    with connect(server) as s:  # their count went with them
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")


def test_an_idle_kept_alive_connection_gets_no_unasked_answer_and_serves_the_next_request(server):
    with connect(server) as s:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")
        s.settimeout(3 * HEAD_S)
        with pytest.raises(socket.timeout):  # idle past the head bound: nothing is written to it
            s.recv(65536)
        s.settimeout(10)
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")
