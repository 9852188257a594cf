"""Schemathesis over the engine's published OpenAPI schema (read with the API key, as the schema is
served behind auth): bounded examples per operation, no answer may be a server error, and normal
requests sent meanwhile all complete."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

FUZZED = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /internal/stats"]
EXAMPLES = 200


@pytest.fixture(scope="module")
def schema(server):
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        assert c.get("/openapi.json").status_code == 401  # the schema is behind auth too
        document = c.get("/openapi.json", headers={"authorization": f"Bearer {API_KEY}"}).json()
    return schemathesis.openapi.from_dict(document)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("label", FUZZED)
def test_fuzzed_requests_never_get_a_server_error(server, schema, label):
    operation = schema.find_operation_by_label(label)
    seen: list[int] = []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    normal: list[str] = []
    stop = threading.Event()

    def steady() -> None:  # a well-behaved client beside the fuzzer
        while not stop.is_set():
            r = client.completions.create(model=MODEL, prompt="steady", max_tokens=4, temperature=0)
            normal.append(r.choices[0].finish_reason)

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data) -> None:
        case = data.draw(operation.as_strategy())
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 64)  # bounded work per example, same validity
        response = case.call(base_url=server.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text[:500])

    beside = threading.Thread(target=steady)
    beside.start()
    try:
        run()
    finally:
        stop.set()
        beside.join(timeout=120)
    assert len(seen) >= (20 if label.startswith("POST") else 1)  # parameterless GETs have one example
    assert normal and set(normal) <= {"length", "stop"}
