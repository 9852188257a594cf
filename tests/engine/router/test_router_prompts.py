"""A disaggregated group's prompts as the router prepares them: off its event loop, refused before any work
when they cannot fit the model, with ids checked against the vocabulary. The router runs as a real uvicorn
server; its prefill and decode "members" are a small app that refuses everything (a request that reaches
it passed the router's checks), so these tests need no engine."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

import engine.router.app as app_module
import engine.router.prompt as prompt_module
import engine.router.proxy as proxy_module
from engine.router.app import create_router_app
from engine.router.config import RouterConfig
from engine.api.cpu_pool import CpuPool
from engine.api.auth import CLIENT_HEADER, key_digest
from engine.api.errors import APIError
from engine.api.inproc import serve_in_thread
from engine.api.protocol import MAX_MESSAGES, ChatCompletionRequest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

CLIENT, ADMIN = "client-key", "admin-key"


SEEN_HEADERS: list[dict] = []


def member_app() -> FastAPI:
    """A stand-in member: ready at once; each test adds the routes it needs."""
    app = FastAPI()

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    return app


def refusing_members() -> FastAPI:
    app = member_app()

    @app.post("/internal/prefill")
    async def prefill(request: Request):
        SEEN_HEADERS.append(dict(request.headers))
        return JSONResponse({"error": {"message": "prefill reached", "type": "invalid_request_error"}},
                            status_code=400)

    return app


@pytest.fixture(scope="module")
def router(tiny_model_dir):
    with serve_in_thread(refusing_members()) as members:
        config = RouterConfig(model_dir=tiny_model_dir, health_interval_s=0.2)
        with serve_in_thread(create_router_app(config, [CLIENT], [ADMIN])) as url:
            with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, trust_env=False,
                              timeout=60) as admin:
                r = admin.post("/admin/groups", json={"name": "pd", "version": "v1", "endpoints": [
                    {"url": members, "role": "prefill"}, {"url": members, "role": "decode"}]})
                assert r.status_code == 200, r.text
                with httpx.Client(base_url=url, headers={"authorization": f"Bearer {CLIENT}"}, trust_env=False,
                                  timeout=60) as client:
                    yield client


def test_a_prompt_that_cannot_fit_is_refused_by_the_router_with_the_real_limit(router):
    """It used to be tokenized on the event loop and expanded into a body the members refused with a false 413."""
    r = router.post("/v1/completions", json={"model": "default", "prompt": "word " * 1_400_000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "cannot fit the model's context of" in error["message"] and error["code"] == "context_length_exceeded"
    r = router.post("/v1/chat/completions", json={"model": "default", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi there " * 2000}]})
    assert r.status_code == 400 and "exceeds the model's context of" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("count, content, needle", [
    (100_000, "hi", "at most 8192 messages are served, not 100000"),
    (8_000, [{"type": "text", "text": "hi"}] * 3, "at most 8192 content parts are served in all, not 24000"),
])
def test_a_chat_body_of_too_many_messages_is_refused_before_one_is_built(router, monkeypatch, count, content, needle):
    """10^5 messages went through validation, templating and tokenization (objects whose collections stalled the
    router's loop for 0.8 s) before the context check refused them."""
    monkeypatch.setattr(ChatCompletionRequest, "model_validate_json", _never)
    messages = [{"role": "user", "content": content}] * count
    r = router.post("/v1/chat/completions", json={"model": "default", "max_tokens": 2, "messages": messages})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages"


def _never(*args, **kwargs):
    raise AssertionError("validated a body its size check should have refused")


def test_a_chat_body_at_the_message_bound_is_validated_as_any_other(router):
    messages = [{"role": "user", "content": "hi"}] * MAX_MESSAGES
    r = router.post("/v1/chat/completions", json={"model": "default", "max_tokens": 2, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = router.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.content"), r.text


@pytest.mark.parametrize("ids, needle", [
    ([1, 2, 2**63], "prompt.2: Input should be less than or equal to 2147483647"),
    ([1] * 16 + [2**64 + 5] * 16, "less than or equal to 2147483647"),
    ([1, 600], "token id 600, outside the vocabulary [0, 512)"),
])
def test_token_ids_out_of_range_are_a_400_from_the_router(router, ids, needle):
    r = router.post("/v1/completions", json={"model": "default", "prompt": ids, "max_tokens": 2})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_prompts_are_prepared_on_the_router_s_worker_threads(router, monkeypatch):
    seen: list[str] = []
    real = prompt_module.prompt_ids

    def recording(tokenizer, body):
        seen.append(threading.current_thread().name)
        return real(tokenizer, body)

    monkeypatch.setattr(prompt_module, "prompt_ids", recording)
    r = router.post("/v1/completions", json={"model": "default", "prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 400 and "prefill reached" in r.text  # past every check of the router
    assert seen and all(name.startswith("router-cpu") for name in seen), seen


SMALL = {"model": "default", "prompt": "hello there", "max_tokens": 2}
LARGE = {"model": "default", "prompt": "word " * 20_000, "max_tokens": 2}  # a body past INLINE_BYTES


@pytest.mark.parametrize("module, step, body, answer", [
    (app_module, "_parse", LARGE, "exceeds the model's context of 4096 tokens"),
    (prompt_module, "prompt_ids", SMALL, "prefill reached"),  # templating and tokenizing
    (proxy_module, "_block_hashes", SMALL, "prefill reached"),
    (proxy_module, "_json", SMALL, "prefill reached"),  # the prefill body
], ids=["parse", "tokenize", "hash", "serialize"])
def test_health_is_answered_while_a_prompt_is_stuck_in_its_preparation(router, monkeypatch, module, step, body,
                                                                       answer):
    """Each step of a prompt's preparation is held until /health has answered: were the step on the event loop,
    the loop would wait with it and the probe would time out (as a 7 MB prompt once stalled every client)."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(module, step)

    def held(*args):
        if not entered.is_set():  # the first call only: the test's one request
            entered.set()
            release.wait(30)
        return real(*args)

    monkeypatch.setattr(module, step, held)
    with ThreadPoolExecutor(1) as sender, httpx.Client(base_url=router.base_url, headers=router.headers,
                                                       trust_env=False, timeout=60) as client:
        pending = sender.submit(client.post, "/v1/completions", json=body)
        try:
            assert entered.wait(10), f"the request never reached {step}: {pending.result(timeout=10).text}"
            assert router.get("/health", timeout=5).json() == {"status": "alive"}
            assert router.get("/v1/models").status_code == 200  # other clients too
        finally:
            release.set()
        r = pending.result(timeout=30)
    assert r.status_code == 400 and answer in r.json()["error"]["message"], r.text  # and went on once let go


def test_a_model_id_is_echoed_clipped(router):
    r = router.post("/v1/completions", json={"model": "m" * 2_000_000, "prompt": "hi"})
    assert r.status_code == 404 and len(r.content) < 1000, len(r.content)
    assert "(2000002 characters)" in r.json()["error"]["message"]


def test_the_pool_refuses_at_once_past_its_waiting_bound():
    async def scenario() -> tuple[list, str]:
        pool = CpuPool(workers=1, max_waiting=2)
        release = threading.Event()
        try:
            held = [asyncio.ensure_future(pool.run(release.wait, 30)) for _ in range(2)]
            await asyncio.sleep(0.05)  # both admitted: one runs, one waits for the worker
            with pytest.raises(APIError) as refused:
                await pool.run(lambda: None)
            release.set()
            return await asyncio.gather(*held), refused.value.message
        finally:
            release.set()
            pool.close()

    results, message = asyncio.run(scenario())
    assert results == [True, True] and "busy preparing 2 large prompts" in message


def test_a_client_that_hangs_up_mid_body_is_one_info_line(router, caplog):
    """300 aborted uploads used to write 2.3 MB of tracebacks at ERROR."""
    url = router.base_url
    caplog.set_level(logging.INFO)
    for _ in range(3):
        with socket.create_connection((url.host, url.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + CLIENT.encode() +
                      b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"model\": ")
    deadline = time.monotonic() + 10
    while sum("hung up" in r.getMessage() for r in caplog.records) < 3:
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert router.get("/health").status_code == 200


def test_members_learn_the_client_as_a_digest_of_its_key_never_the_key(router):
    SEEN_HEADERS.clear()
    r = router.post("/v1/completions", json={"model": "default", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400 and "prefill reached" in r.text
    (headers,) = SEEN_HEADERS
    assert headers[CLIENT_HEADER] == key_digest(CLIENT)
    assert not any(CLIENT in value for value in headers.values())


def slow_member() -> FastAPI:
    app = member_app()

    @app.post("/v1/completions")
    async def completions():
        async def tokens():
            chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "default",
                     "choices": [{"index": 0, "text": "a"}], "tideflow": {"token_ids": [5], "seed": None}}
            for _ in range(20):
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0.05)
            yield "data: [DONE]\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    return app


def test_a_key_past_its_open_requests_gets_429_and_the_others_are_served():
    with serve_in_thread(slow_member()) as member:
        config = RouterConfig(max_open_per_key=1, health_interval_s=0.2)
        with serve_in_thread(create_router_app(config, [CLIENT, "other-key"], [ADMIN])) as url:
            admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, trust_env=False)
            assert admin.post("/admin/groups", json={"name": "slow", "version": "v1", "endpoints": [
                {"url": member, "role": "colocated"}]}).status_code == 200
            body = {"model": "default", "prompt": "hi", "max_tokens": 20, "stream": True}

            def post(key: str) -> httpx.Response:
                with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, trust_env=False,
                                  timeout=30) as c:
                    return c.post("/v1/completions", json=body)

            with httpx.Client(base_url=url, headers={"authorization": f"Bearer {CLIENT}"}, trust_env=False,
                              timeout=30) as first:
                with first.stream("POST", "/v1/completions", json=body) as held:
                    assert held.status_code == 200
                    lines = held.iter_lines()  # kept: a dropped iterator closes the stream, which frees the slot
                    assert next(lines).startswith("data:")  # the stream is open: its slot is taken
                    refused = post(CLIENT)
                    assert refused.status_code == 429 and "requests open" in refused.json()["error"]["message"]
                    assert post("other-key").status_code == 200
                    assert "data: [DONE]" in list(lines)  # the held stream ran to its end
            assert post(CLIENT).status_code == 200  # the ended stream gave its slot back
            admin.close()
