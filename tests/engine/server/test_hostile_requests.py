"""One client cannot hurt another: requests that used to crash a batch or the connection are either
refused at the boundary with a 400 naming the field, or served alone; the requests beside them finish."""

from __future__ import annotations

import threading

import openai
import pytest
import torch

from engine.core.sampling import sample
from engine.core.sampling_params import SamplingParams, resolve_seed
from tests.engine.server.conftest import API_KEY, MODEL, wait_until

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_degenerate_sampling_parameters_give_a_token_not_an_error():
    logits = torch.randn(3, 64)
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=5e-324),
              SamplingParams(temperature=0.7, top_k=1)]
    tokens = [s.token for s in sample(logits, params, [resolve_seed(p) for p in params], [0] * len(params))]
    best = logits.argmax(dim=-1).tolist()
    assert tokens == best  # each of these asks for the most likely token


def test_a_row_without_a_distribution_fails_alone():
    logits = torch.randn(3, 64)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2), SamplingParams()]
    tokens = [s.token for s in sample(logits, params, [resolve_seed(p) for p in params], [0] * len(params))]
    assert tokens[1] is None and isinstance(tokens[0], int) and tokens[2] == int(logits[2].argmax())


@pytest.mark.parametrize("field,value", [("seed", 2**64), ("seed", -(2**63) - 1), ("top_p", 0.0), ("top_p", 1.5)])
def test_out_of_range_fields_are_a_400_naming_the_field(server, field, value):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, field: value}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    assert field in str(info.value.message or info.value.body)
    with server.client() as c:  # the connection stays usable and the server keeps serving
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("raw", ['{"model": "tiny", "prompt": "x", "temperature": NaN}',
                                 '{"model": "tiny", "prompt": "x", "top_p": Infinity}',
                                 '{"model": "tiny", "prompt": "x", "seed": 18446744073709551616}',
                                 '{"model": "tiny", "prompt": "\\ud800 lone surrogate"}',
                                 '{"model": "tiny", "prompt": ["\\udfff"]}',
                                 '{"model": "tiny", "prompt": "x", "stop": ["ok", "\\ud800"]}',
                                 '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'])
def test_non_finite_and_huge_numbers_in_raw_json_are_a_400(server, raw):
    with server.client() as c:
        api = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
        r = c.post(api, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/health").status_code == 200  # same connection, still served


def test_hostile_requests_in_the_same_batch_leave_the_others_whole(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    normal: list[str] = []
    hostile: list[str] = []

    def ask_normal() -> None:
        r = client.completions.create(model=MODEL, prompt="the same batch", max_tokens=8, temperature=0)
        normal.append(r.choices[0].finish_reason)

    def ask_hostile(kw: dict) -> None:
        r = client.completions.create(model=MODEL, prompt="the same batch", max_tokens=8, **kw)
        hostile.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=ask_normal) for _ in range(6)]
    threads += [threading.Thread(target=ask_hostile, args=(kw,)) for kw in
                ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324}, {"seed": 2**64 - 1, "temperature": 1})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert normal == ["length"] * 6
    assert sorted(hostile) == ["length"] * 3


def test_an_oversized_body_is_a_413_before_any_work(server):
    big = '{"model": "tiny", "prompt": "' + "x" * (9 << 20) + '"}'
    before = server.counter("tideflow_requests_total", status="ok")
    with server.client() as c:
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        chunked = c.post("/v1/completions", content=iter([big[i:i + 65536].encode() for i in range(0, len(big), 65536)]),
                         headers={"content-type": "application/json"})
        assert chunked.status_code == 413  # no Content-Length: counted as it arrives
        assert c.get("/health").status_code == 200
    assert server.counter("tideflow_requests_total", status="ok") == before


def test_stats_are_current_after_aborted_requests(server):
    with server.client() as c:
        free = c.get("/internal/stats").json()["kv_blocks_free"]
        body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 2000, "stream": True,
                "ignore_eos": True}
        for _ in range(2):
            with c.stream("POST", "/v1/completions", json=body) as r:
                next(r.iter_lines())  # the request runs; the client then goes away mid-stream
        assert wait_until(lambda: c.get("/internal/stats").json() == {"ready": True, "queued": 0, "running": 0,
                                                                      "kv_blocks_free": free,
                                                                      "queued_prefill_tokens": 0}, timeout=30)
