"""The official openai client against a real server: completions, chat, streaming, batching, caching."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from engine.offline.default_model import TINY_CONFIG
from engine.offline.generate import generate
from engine.core.llm_engine import EngineConfig
from engine.model.loader import load_model
from engine.model.paged import kv_bytes_per_block
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import ChatMessage, Tokenizer
from tests.engine.server.conftest import API_KEY, MODEL, serve

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model, tok = load_model(tiny_model_dir), Tokenizer(tiny_model_dir)

    def run(prompts: list[list[int]], params: SamplingParams | list[SamplingParams]):
        return generate(model, tok, prompts, params)

    run.tokenizer = tok
    return run


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def aclient(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_models_lists_the_served_model(server):
    assert [m.id for m in client(server).models.list().data] == [MODEL]


def test_completion_matches_generate_with_usage(server, reference):
    prompt = "The quick brown fox"
    ids = reference.tokenizer.encode(prompt)
    want = reference([ids], SamplingParams(max_tokens=12))[0]
    got = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == len(want.tokens)
    assert got.usage.total_tokens == len(ids) + len(want.tokens)


def test_streaming_completion_joins_to_the_same_text(server, reference):
    ids = reference.tokenizer.encode("Streams of text")
    want = reference([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    chunks = list(client(server).completions.create(
        model=MODEL, prompt=ids, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_chat_streaming_and_not(server, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    tok = reference.tokenizer
    prompt = tok.encode(tok.apply_chat_template([ChatMessage(**m) for m in messages]))
    want = reference([prompt], SamplingParams(max_tokens=16))[0]
    c = client(server)
    got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(prompt)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason is not None


def test_seeded_sampling_is_reproducible(server):
    c = client(server)
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 50, "ignore_eos": True})
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


def _mixed_prompts(seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


async def _complete_all(served, prompts, max_tokens: list[int], **extra):
    async with aclient(served) as c:
        return await asyncio.gather(*(
            c.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0, extra_body=extra or None)
            for p, m in zip(prompts, max_tokens)
        ))


def test_sixteen_concurrent_greedy_requests_equal_generate(server, reference):
    prompts = _mixed_prompts(1, 16, 3, 300)
    max_tokens = [random.Random(i).randrange(4, 40) for i in range(16)]
    want = reference(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    got = asyncio.run(_complete_all(server, prompts, max_tokens))
    assert [g.choices[0].text for g in got] == [w.text for w in want]
    assert [g.usage.completion_tokens for g in got] == [len(w.tokens) for w in want]


def test_shared_prefix_computes_only_the_suffix(server, reference):
    prefix = _mixed_prompts(2, 1, 256, 257)[0]
    first, second = prefix + [5, 6, 7, 8, 9], prefix + [11, 12, 13]
    c = client(server)
    c.completions.create(model=MODEL, prompt=first, max_tokens=4, temperature=0)
    hits = server.counter("tideflow_prefix_cache_hit_blocks_total")
    computed = server.counter("tideflow_prefill_computed_tokens_total")
    got = c.completions.create(model=MODEL, prompt=second, max_tokens=6, temperature=0)
    assert server.counter("tideflow_prefix_cache_hit_blocks_total") - hits == 256 // 16
    assert server.counter("tideflow_prefill_computed_tokens_total") - computed == len(second) - 256
    assert got.choices[0].text == reference([second], SamplingParams(max_tokens=6))[0].text


def test_kv_exhaustion_preempts_and_every_request_completes(tiny_model_dir, reference):
    prompts = _mixed_prompts(3, 32, 40, 90)
    config = EngineConfig(kv_cache_bytes=24 * kv_bytes_per_block(TINY_CONFIG, 16), max_batch_tokens=128, max_wait_ms=0)
    with serve(tiny_model_dir, config) as served:
        got = asyncio.run(_complete_all(served, prompts, [40] * 32, ignore_eos=True))
        assert served.counter("tideflow_preemptions_total") > 0
        assert served.engine.allocator.num_used == 0
    want = reference(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [g.choices[0].finish_reason for g in got] == ["length"] * 32
    assert [g.choices[0].text for g in got] == [w.text for w in want]


def test_usage_counts_cached_prompt_tokens_and_a_cache_salt_shares_with_its_own_only(server):
    c = client(server)
    prompt = [random.Random(21).randrange(3, 500) for _ in range(80)]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return got.usage.prompt_tokens_details.cached_tokens

    assert cached(None) == 0
    assert cached(None) == 64  # four whole blocks of 16 (the last token is always computed)
    assert cached("tenant-a") == 0 and cached("tenant-b") == 0  # neither shares the unsalted blocks, nor each other's
    assert cached("tenant-a") == 64
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})
