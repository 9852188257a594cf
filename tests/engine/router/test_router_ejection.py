"""A member that stops before it sends its answer's head (a decode member pulling KV, an engine hung on admission)
sends no heartbeat the stall timeout could miss: the request used to wait first_token_timeout_s for it. Once the
health checks eject the member, the request moves to another group."""

from __future__ import annotations

import asyncio
import threading

import pytest

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from engine.router.app import create_router_app
from engine.router.config import RouterConfig
from engine.api.inproc import serve_in_thread
from tests.engine.router.test_router_hardening import _event

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

CLIENT, ADMIN = "client-key", "admin-key"


def stuck_member(state: dict) -> FastAPI:
    """Ready until asked for an answer; then silent (no head) and failing its health checks, as a stopped one."""
    app = FastAPI()

    @app.get("/ready")
    async def ready():
        return JSONResponse({"status": "stuck"}, status_code=503) if state["stuck"] else {"status": "ready"}

    @app.post("/v1/completions")
    async def completions(body: dict):
        state["stuck"] = True
        for _ in range(1200):  # 60 s, or until the test lets it go
            if state["release"].is_set():
                break
            await asyncio.sleep(0.05)
        return JSONResponse({}, status_code=500)

    return app


def fine_member() -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    @app.post("/v1/completions")
    async def completions(body: dict):
        async def answer():
            yield _event("a", [5], prompt=[1, 2])
            yield _event("b", [6], "length")
            yield "data: [DONE]\n\n"

        return StreamingResponse(answer(), media_type="text/event-stream")

    return app


def test_a_member_silent_before_its_head_is_left_once_ejected():
    state = {"stuck": False, "release": threading.Event()}
    with serve_in_thread(stuck_member(state)) as stuck, serve_in_thread(fine_member()) as fine:
        config = RouterConfig(health_interval_s=0.2, first_token_timeout_s=60.0, max_attempts=2)
        with serve_in_thread(create_router_app(config, [CLIENT], [ADMIN])) as url:
            with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, trust_env=False) as admin:
                for name, upstream, weight in (("stuck", stuck, 1000.0), ("fine", fine, 1.0)):  # stuck is tried first
                    r = admin.post("/admin/groups", json={"name": name, "version": "v1", "weight": weight,
                                                          "endpoints": [{"url": upstream, "role": "colocated"}]})
                    assert r.status_code == 200, r.text
            # waiting out first_token_timeout_s (60 s) would outlast this client's 30 s
            with httpx.Client(base_url=url, headers={"authorization": f"Bearer {CLIENT}"}, trust_env=False,
                              timeout=30) as client:
                try:
                    r = client.post("/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
                finally:
                    state["release"].set()  # the stuck handler ends: its server stops at once
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab", r.text
            assert state["stuck"]  # the stuck member did get the request first
