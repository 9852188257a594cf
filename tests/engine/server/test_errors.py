"""Bad input, auth, readiness, back-pressure and cancellation: status codes and OpenAI error bodies."""

from __future__ import annotations

import httpx
import pytest

from engine.core.llm_engine import EngineConfig
from tests.engine.server.conftest import MODEL, serve, wait_until

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"model": MODEL, "prompt": "hi", "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "stop": [str(i) for i in range(9)]}, 400, "stop"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 4096}, 400, "prompt"),
    ({"model": MODEL, "prompt": list(range(3, 500)) * 10}, 400, "prompt"),
    # JSON types as OpenAI documents them: lax parsing streamed "false" and took true as 1
    ({"model": MODEL, "prompt": "hi", "stream": "false"}, 400, "stream"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"model": MODEL, "prompt": [1, 2**63]}, 400, "prompt.1"),
    # fields not implemented are refused, never a 200 that means something else
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": "x" * 100_000, "prompt": "hi"}, 404, "model"),
])
def test_bad_completion_requests(server, body, status, param):
    with server.client() as c:
        error = assert_error(c.post("/v1/completions", json=body), status, param)
    assert len(error["message"]) < 400  # an input is quoted at most 200 characters long


@pytest.mark.parametrize("api, body", [
    ("completions", {"prompt": "word " * 200_000}),
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}]}),
])
def test_a_prompt_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(server, monkeypatch, api, body):
    """A member serving clients itself bounds the cost as the router does: 4 prompts of 7 MB took both cores of a
    2-core member for seconds (its /health answered in 586 ms) only to be refused after tokenizing."""
    from engine.model.tokenizer import Tokenizer
    monkeypatch.setattr(Tokenizer, "encode", _never)
    with server.client() as c:
        error = assert_error(c.post(f"/v1/{api}", json={"model": MODEL, **body}), 400,
                             "prompt" if api == "completions" else "messages")
    assert error["code"] == "context_length_exceeded" and "characters cannot fit" in error["message"], error


def _never(*args, **kwargs):
    raise AssertionError("tokenized a prompt its length alone should have refused")


def test_unserved_fields_at_their_defaults_are_served(server):
    """Clients that send every field at its default (as some SDKs do) are not refused."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 1, "echo": False,
            "presence_penalty": 0, "frequency_penalty": 0.0, "suffix": None}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_bad_chat_requests(server):
    with server.client() as c:
        assert_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400, "messages")
        bad_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
        assert_error(c.post("/v1/chat/completions", json=bad_role), 400, "messages.0.role")


def test_malformed_json_is_a_400_error_object(server):
    with server.client() as c:
        r = c.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
        assert "JSON" in assert_error(r, 400)["message"]
        assert_error(c.post("/v1/nothing-here", json={}), 404)


def test_api_keys_guard_every_route_but_health_and_ready(server):
    with server.client(key=None) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").json() == {"status": "ready", "model": MODEL}  # probes carry no key
        for path in ("/metrics", "/internal/stats", "/v1/models"):
            assert_error(c.get(path), 401)
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 401)
    with server.client(key="wrong") as c:
        assert_error(c.get("/v1/models"), 401)
    with server.client() as c:
        assert c.get("/v1/models").status_code == 200


def test_metrics_are_prometheus_text(server):
    with server.client() as c:
        c.post("/v1/completions", json={"model": MODEL, "prompt": "count me", "max_tokens": 3, "temperature": 0})
        text = c.get("/metrics").text
    for name in ("tideflow_time_to_first_token_seconds_bucket", "tideflow_kv_blocks_free", "tideflow_queue_depth",
                 "tideflow_departure_size_count", "tideflow_generation_tokens_total", 'status="http_404"'):
        assert name in text


def test_not_ready_answers_503(tiny_model_dir):
    with serve(tiny_model_dir, EngineConfig(kv_cache_bytes=1 << 20), warm_up=False) as s, s.client() as c:
        assert c.get("/health").status_code == 200
        assert_error(c.get("/ready"), 503)
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}), 503)


def test_queue_full_is_429_and_disconnects_cancel(tiny_model_dir):
    long = {"model": MODEL, "prompt": "go on", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    config = EngineConfig(kv_cache_bytes=4 << 20, max_num_seqs=1, max_queue=1, max_wait_ms=0)
    with serve(tiny_model_dir, config) as s, s.client() as c:
        engine = s.engine
        with c.stream("POST", "/v1/completions", json=long | {"stream": True}) as running:
            events = running.iter_lines()  # keep the iterator: dropping it closes the connection
            next(events)  # first event: the request is running
            with c.stream("POST", "/v1/completions", json=long | {"stream": True}) as queued:
                assert queued.status_code == 200 and engine.num_queued == 1
                assert_error(c.post("/v1/completions", json=long), 429)
        assert wait_until(lambda: engine.num_running == 0 and engine.num_queued == 0)
        assert wait_until(lambda: engine.allocator.num_used == 0)
        assert s.counter("tideflow_requests_total", status="aborted") == 2
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=long, timeout=httpx.Timeout(30, read=0.5))
        assert wait_until(lambda: engine.num_running == 0 and engine.allocator.num_used == 0)
        assert s.counter("tideflow_requests_total", status="aborted") == 3


def test_engine_refusals_carry_openai_style_codes(server):
    """An engine refusal's code used to be its Python class name ("PromptTooLong"); clients match snake_case codes,
    and the same refusal from the size check before tokenizing says context_length_exceeded."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": list(range(3, 300)), "max_tokens": 4000})
    error = assert_error(r, 400, "prompt")
    assert error["code"] == "context_length_exceeded", error
