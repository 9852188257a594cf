"""The bounded reads' flags (engine.api.connection_limits): every server's command takes them with the
model's defaults, refuses a bad value as a usage error naming the flag, and the server it starts applies them
(a member, the encoder, the router and the controller, each started as users start them). A member's router
may hold a connection for every request the member's engine admits."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import subprocess

import httpx
import pytest
from fastapi import FastAPI

from engine.control.local_runtime import stop_recorded_fleet
from engine.encoder.vision import write_vision_encoder
from engine.main import build_parser
from engine.runtime.process import free_port, start_service, tideflow_argv, wait_http_ok
from engine.server.cli import engine_config, member_connection_limits
from engine.api import connection_limits
from engine.api.connection_limits import ConnectionLimits
from engine.api.connections import bounded_protocol
from engine.api.inproc import serve_in_thread

from tests.conftest import assert_nothing_left
from tests.engine.server.test_connections import connect, read_all, read_response

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

HEAD_S = 0.5
CAP = 4  # room for the connections a controller's own router holds to it
BOUNDS = ["--header-timeout-s", str(HEAD_S), "--body-timeout-s", str(HEAD_S), "--max-connections-per-address", str(CAP)]
KEY = "bounds-key"
COMMANDS = {"serve": ["serve", "--model", "/models/m"], "router": ["router"], "controller": ["controller"]}


def test_the_flags_build_the_model_with_the_model_s_defaults():
    parser = argparse.ArgumentParser()
    connection_limits.add_arguments(parser)
    assert connection_limits.from_args(parser.parse_args([])) == ConnectionLimits()
    given = parser.parse_args(["--max-connections-per-address", "3", "--header-timeout-s", "0.5"])
    assert connection_limits.from_args(given) == ConnectionLimits(max_connections_per_address=3, header_timeout_s=0.5)
    assert connection_limits.from_args(given, body_timeout_s=7, max_connections_per_address=9) == ConnectionLimits(
        max_connections_per_address=3, header_timeout_s=0.5, body_timeout_s=7), "a given flag beats a server's default"
    usage = " ".join(parser.format_help().split())
    for name, field in ConnectionLimits.model_fields.items():
        assert f"--{name.replace('_', '-')}" in usage and f"{field.description}; default {field.default}" in usage


@pytest.mark.parametrize("command", ["router", "controller"])
def test_every_server_takes_the_flags(command):
    parser = build_parser()
    assert connection_limits.from_args(parser.parse_args(COMMANDS[command])) == ConnectionLimits()
    assert connection_limits.from_args(parser.parse_args([*COMMANDS[command], *BOUNDS])) == ConnectionLimits(
        header_timeout_s=HEAD_S, body_timeout_s=HEAD_S, max_connections_per_address=CAP)


def test_a_member_s_router_may_hold_a_connection_per_request_its_engine_admits():
    parser = build_parser()
    args = parser.parse_args(COMMANDS["serve"])
    assert member_connection_limits(args, engine_config(args)) == ConnectionLimits(
        max_connections_per_address=256 + 64 + 256)
    args = parser.parse_args([*COMMANDS["serve"], "--max-num-seqs", "8", "--max-queue", "1000"])
    assert member_connection_limits(args, engine_config(args)).max_connections_per_address == 256 + 8 + 1000
    args = parser.parse_args([*COMMANDS["serve"], *BOUNDS])
    assert member_connection_limits(args, engine_config(args)) == ConnectionLimits(
        header_timeout_s=HEAD_S, body_timeout_s=HEAD_S, max_connections_per_address=CAP)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag,value,says", [
    ("--max-connections-per-address", "0", "greater than or equal to 1"),
    ("--header-timeout-s", "-1", "greater than 0"),
    ("--body-timeout-s", "soon", "a valid number"),
])
def test_a_bad_bound_is_a_usage_error_naming_the_flag(command, flag, value, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*COMMANDS[command], flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: '{value}': Input should be {says}" in capsys.readouterr().err


def test_a_member_s_default_cap_serves_every_request_its_engine_admits_from_one_router():
    """64 running + 256 queued requests at once from one address, through an httpx pool as the router's (one
    connection per open request): with the allowance of 256 alone, 64 of them were refused with 503."""
    args = build_parser().parse_args(COMMANDS["serve"])
    config = engine_config(args)
    app = FastAPI()

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(1.0)
        return {"ok": True}

    async def router_like(url: str) -> collections.Counter:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            async def one():
                return (await client.get(url + "/slow")).status_code

            return collections.Counter(await asyncio.gather(*[one() for _ in range(config.max_num_seqs +
                                                                                     config.max_queue)]))

    protocol = bounded_protocol(member_connection_limits(args, config))
    with serve_in_thread(app, http=protocol, timeout_keep_alive=30) as url:
        assert asyncio.run(router_like(url)) == {200: config.max_num_seqs + config.max_queue}


@contextlib.contextmanager
def started(kind: str, tmp_path, monkeypatch, model_dir):
    """`kind` started through its command with BOUNDS; yields its URL and a body-reading (method, path)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"TIDEFLOW_API_KEYS": KEY, "TIDEFLOW_ADMIN_KEYS": "admin-key"}
    log = tmp_path / f"{kind}.log"
    if kind == "controller":
        monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path / "home"))
        child = start_service(kind, tideflow_argv("controller", "--port", str(port), "--model-dir", str(model_dir),
                                                  *BOUNDS), log, url + "/health", timeout_s=120)
        try:
            yield url, "PUT", "/v1/weights"
        finally:
            try:
                down = subprocess.run(tideflow_argv("down"), capture_output=True, text=True, timeout=180)
                assert down.returncode == 0, down.stderr
            finally:
                child.stop(grace_s=60)
                stop_recorded_fleet()
                assert_nothing_left(tmp_path / "home")
        return
    if kind == "router":
        argv, ready, body_route = tideflow_argv("router", "--port", str(port), *BOUNDS), "/health", "/v1/completions"
    else:
        role = ["--role", "encoder"] if kind == "encoder" else []
        argv = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--kv-cache-bytes", str(8 << 20),
                             *role, *BOUNDS)
        ready, body_route = "/ready", "/internal/encode" if kind == "encoder" else "/v1/completions"
    child = start_service(kind, argv, log, url + "/health", timeout_s=120, env=env)
    try:
        assert wait_http_ok(url + ready, 120, child, KEY), child.log_tail()
        yield url, "POST", body_route
    finally:
        child.stop()


@pytest.fixture
def encoder_model_dir(tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    write_vision_encoder(model, hidden_size=64, seed=3)
    return model


@pytest.mark.parametrize("kind", ["member", "encoder", "router", "controller"])
def test_a_server_started_with_the_flags_applies_them(kind, tmp_path, monkeypatch, request):
    model_dir = request.getfixturevalue("encoder_model_dir" if kind == "encoder" else "tiny_model_dir")
    with started(kind, tmp_path, monkeypatch, model_dir) as (url, method, body_route):
        port = int(url.rsplit(":", 1)[1])
        held, refusal = [], b""
        try:
            while not refusal and len(held) <= CAP:  # other clients on this address may hold some already
                s = connect(port)
                held.append(s)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = read_response(s)
                if not answer.startswith(b"HTTP/1.1 200"):
                    refusal = answer
        finally:
            for s in held:
                s.close()
        assert refusal.startswith(b"HTTP/1.1 503") and f"holds {CAP} connections".encode() in refusal, refusal
        with connect(port) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 408") and f"no request head within {HEAD_S:g}s".encode() in answer
        with connect(port) as s:
            s.sendall(f"{method} {body_route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode())
            answer = read_response(s)
        assert answer.startswith(b"HTTP/1.1 408") and f"stalled for {HEAD_S:g}s".encode() in answer, answer
