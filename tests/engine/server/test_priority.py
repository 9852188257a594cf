"""A request's priority (lower runs first) is bounded by what its API key may ask for: a key file line
`KEY priority>=N`; a plain key may only defer its own requests (priority >= 0). Checked where client keys are
checked (the router; a member serving clients directly), with a 403 naming the bound; a member trusts the
router's word for a request it forwarded."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.core.llm_engine import EngineConfig
from engine.router.app import create_router_app
from engine.router.config import RouterConfig
from engine.api.auth import CLIENT_HEADER, ApiKey, BearerAuth, key_digest, key_source
from engine.api.inproc import serve_in_thread
from engine.api.protocol import CompletionRequest

from .conftest import MODEL, serve

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

KEYS = [ApiKey.parse("urgent-key priority>=-10"), ApiKey.parse("plain-key"), ApiKey.parse("router-key forwards")]


def test_key_entries_carry_their_priority_floor(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# operators\nops-key priority>=-100\n\nbatch-key priority>=5\n")
    keys = key_source(keys_file, environ={"TIDEFLOW_API_KEYS": "a-key, b-key priority>=-2"}).keys()
    assert [(k.key, k.priority_floor) for k in keys] == [("a-key", 0), ("b-key", -2), ("ops-key", -100),
                                                        ("batch-key", 5)]
    for bad in ("k priority=-1", "k urgent>=1", "k priority>=x", "k priority>=-99999999999"):
        with pytest.raises(ValueError):
            ApiKey.parse(bad)
    with pytest.raises(ValueError, match="repeats an earlier key") as refused:
        key_source(keys_file, environ={"TIDEFLOW_API_KEYS": "batch-key"})  # plain here, priority>=5 in the file
    assert "batch-key" not in str(refused.value)
    assert "ops-key" not in repr(keys[2]) and "ops-key" not in str(keys[2])


def test_the_priority_reaches_the_engine_with_the_sampling_params():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "priority": -3})
    assert body.sampling_params(4).priority == -3


@pytest.fixture(scope="module")
def member(tiny_model_dir):
    with serve(tiny_model_dir, EngineConfig(max_num_seqs=4, kv_cache_bytes=8 << 20), keys=KEYS) as served:
        yield served


@pytest.mark.parametrize("key, priority, status", [
    ("plain-key", 0, 200), ("plain-key", 3, 200), ("plain-key", -1, 403),
    ("urgent-key", -10, 200), ("urgent-key", -11, 403),
])
def test_a_member_serving_clients_bounds_each_key_s_priority(member, key, priority, status):
    with member.client(key) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": priority})
    assert r.status_code == status, r.text
    if status == 403:
        error = r.json()["error"]
        assert error["param"] == "priority" and error["code"] == "priority_not_allowed"
        assert "priority >= " in error["message"]


@pytest.mark.parametrize("key, status", [("router-key", 200), ("plain-key", 403)])
def test_a_member_takes_the_router_s_word_and_only_the_router_s(member, key, status):
    """The router's key forwards: the request names its client and was bounded by that client's key at the
    router. A client key sending the same header gets its own bound."""
    with member.client(key) as c:
        r = c.post("/v1/chat/completions", headers={CLIENT_HEADER: "0123456789abcdef"},
                   json={"model": MODEL, "max_tokens": 2, "priority": -50, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == status, r.text


def request_with(key: str, named: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())]
    if named:
        headers.append((CLIENT_HEADER.encode(), named.encode()))
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


def test_only_a_forwarding_key_names_the_client_it_serves():
    auth = BearerAuth(KEYS)
    assert auth.client_of(request_with("router-key", "0123456789abcdef")) == "0123456789abcdef"
    assert auth.client_of(request_with("plain-key", "0123456789abcdef")) == key_digest("plain-key")
    assert auth.client_of(request_with("router-key", None)) == ""  # a router without client keys: unnamed
    assert BearerAuth([]).client_of(request_with("anything", "x")) == ""


@pytest.mark.parametrize("path, body", [
    ("/internal/resume", {"api": "completions", "prompt_token_ids": [1, 2], "resume": {"output_token_ids": [3]},
                          "request": {"model": MODEL, "prompt": [1, 2], "max_tokens": 4, "priority": -1}}),
])
def test_the_internal_routes_bound_a_client_key_s_priority_too(member, path, body):
    """A member serving clients directly also serves the routes the router uses: a client key may call them."""
    with member.client("plain-key") as c:
        r = c.post(path, json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed", r.text
    with member.client("router-key") as c:
        assert c.post(path, json=body).status_code == 200


@pytest.mark.parametrize("priority", [2**31, "1", 1.5, None])
def test_a_priority_that_is_no_32_bit_integer_is_a_400(member, priority):
    with member.client("urgent-key") as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": priority})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text


FORWARDED: list[dict] = []


def recording_member() -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    async def ready():
        return {"status": "ready"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        FORWARDED.append(await request.json())
        return JSONResponse({"error": {"message": "recorded", "type": "invalid_request_error"}}, status_code=400)

    return app


def test_the_router_bounds_the_client_s_key_and_forwards_what_it_allowed():
    with serve_in_thread(recording_member()) as upstream:
        config = RouterConfig(health_interval_s=0.2)
        with serve_in_thread(create_router_app(config, KEYS, ["admin-key"])) as url:
            with httpx.Client(base_url=url, headers={"authorization": "Bearer admin-key"}, trust_env=False) as admin:
                assert admin.post("/admin/groups", json={"name": "g", "version": "v1", "endpoints": [
                    {"url": upstream, "role": "colocated"}]}).status_code == 200

            def post(key: str, priority: int) -> httpx.Response:
                with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, trust_env=False,
                                  timeout=30) as c:
                    return c.post("/v1/completions", json={"model": "default", "prompt": "hi", "priority": priority})

            FORWARDED.clear()
            refused = post("plain-key", -1)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "priority_not_allowed"
            assert FORWARDED == []  # refused at the router: no member saw it
            assert post("urgent-key", -5).status_code == 400  # the stand-in member's answer
            assert [body["priority"] for body in FORWARDED] == [-5]
