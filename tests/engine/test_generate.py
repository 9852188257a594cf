"""The reference generation loop: batch invariance, sampling controls, stop handling."""

from __future__ import annotations

import pytest

from engine.offline.generate import generate
from engine.model.loader import load_model
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), Tokenizer(tiny_model_dir)


PROMPTS = ["the quick brown fox", "a", "Return the value of the expression; raise an exception when it fails to"]


def test_batched_greedy_equals_one_at_a_time(tiny):
    model, tok = tiny
    ids = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batched = generate(model, tok, ids, params)
    single = [generate(model, tok, [p], params)[0] for p in ids]
    assert [b.tokens for b in batched] == [s.tokens for s in single]
    assert all(len(b.tokens) == 12 and b.finish_reason == "length" for b in batched)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny):
    model, tok = tiny
    ids = [tok.encode(PROMPTS[0])]
    hot = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, top_k=50, seed=11, ignore_eos=True)
    a = generate(model, tok, ids, hot)[0].tokens
    b = generate(model, tok, ids, hot)[0].tokens
    greedy = generate(model, tok, ids, SamplingParams(max_tokens=16, ignore_eos=True))[0].tokens
    assert a == b
    assert a != greedy


def test_top_k_one_is_greedy(tiny):
    model, tok = tiny
    ids = [tok.encode(PROMPTS[2])]
    k1 = SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    assert generate(model, tok, ids, k1)[0].tokens == generate(model, tok, ids, greedy)[0].tokens


def test_stop_string_cuts_text_and_ends_early(tiny):
    model, tok = tiny
    ids = [tok.encode(PROMPTS[0])]
    free = generate(model, tok, ids, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = free.text[5:8]
    assert stop.strip(), "the free-running text is too short to pick a stop string from"
    cut = generate(model, tok, ids, SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert len(cut.tokens) < len(free.tokens)


def test_bad_sampling_values_are_rejected():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
