"""The per-client cap on open tokens: a key that holds its cap is refused with a 429 that says why, another key is
not, and the tokens come back however a request leaves (finished, aborted, failed)."""

from __future__ import annotations

import openai
import pytest

from engine.core.engine_config import EngineConfig
from engine.core.admission import QueueFull
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.model.loader import load_model
from engine.api.auth import key_digest
from engine.model.tokenizer import Tokenizer
from tests.engine.server.conftest import API_KEY, MODEL, serve, wait_until

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

PROMPT = list(range(3, 23))  # 20 tokens


@pytest.fixture
def engine(tiny_model_dir):
    made = LLMEngine(load_model(tiny_model_dir), Tokenizer(tiny_model_dir),
                     EngineConfig(kv_cache_bytes=16 << 20, max_client_tokens=100, max_wait_ms=0))
    yield made
    made.stop()


def test_a_client_at_its_cap_is_refused_and_another_is_not(engine):
    params = SamplingParams(max_tokens=30, ignore_eos=True)  # 50 tokens a request
    engine.submit(PROMPT, params, lambda out: None, client="flood")
    engine.submit(PROMPT, params, lambda out: None, client="flood")
    with pytest.raises(QueueFull, match="100 tokens .* may have 100; this request adds 50"):
        engine.submit(PROMPT, params, lambda out: None, client="flood")
    engine.submit(PROMPT, params, lambda out: None, client="other")
    assert (engine.client_tokens.held("flood"), engine.client_tokens.held("other")) == (100, 50)
    big = SamplingParams(max_tokens=400, ignore_eos=True)  # alone above the cap, and nothing held: admitted
    engine.submit(PROMPT, big, lambda out: None, client="newcomer")
    for _ in range(3):  # "" is every caller the server cannot tell apart: never capped as one client
        engine.submit(PROMPT, params, lambda out: None, client="")


def test_the_default_cap_is_sixteen_whole_contexts(tiny_model_dir):
    """A chat request without max_tokens asks for the rest of the context: a fixed default cap would let a key
    of a long-context model hold one or two of them."""
    made = LLMEngine(load_model(tiny_model_dir), Tokenizer(tiny_model_dir), EngineConfig(kv_cache_bytes=16 << 20))
    try:
        assert made.client_tokens.cap == 16 * made.max_model_len
    finally:
        made.stop()


def test_tokens_come_back_when_requests_finish_or_are_aborted(engine):
    engine.start()
    finished = engine.generate([PROMPT], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(finished[0].token_ids) == 5
    endless = engine.submit(PROMPT, SamplingParams(max_tokens=80, ignore_eos=True), lambda out: None, client="k")
    assert engine.client_tokens.held("k") == 100
    engine.abort(endless)
    assert wait_until(lambda: engine.client_tokens.held("k") == 0, timeout=30)
    assert engine.client_tokens.held("") == 0  # the generate() requests gave theirs back too


def test_over_http_the_refusal_is_a_429_naming_the_cap_and_another_key_is_served(tiny_model_dir):
    config = EngineConfig(kv_cache_bytes=16 << 20, max_client_tokens=64, max_wait_ms=0)
    with serve(tiny_model_dir, config, keys=(API_KEY, "other-key")) as served:
        held = served.engine.submit(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), lambda out: None,
                                    client=key_digest(API_KEY))  # 60 tokens of this key's, open
        try:
            client = openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
            with pytest.raises(openai.RateLimitError, match="may have 64; this request adds 24"):
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
            other = openai.OpenAI(base_url=served.url + "/v1", api_key="other-key", max_retries=0, timeout=60)
            assert other.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].finish_reason
        finally:
            served.engine.abort(held)
