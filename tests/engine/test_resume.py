"""A request resumed on another engine from what its client already has goes on exactly as it would have:
the same token ids and, joined to the text the client got, the same text (greedy and seeded sampling)."""

from __future__ import annotations

import queue

import pytest

from engine.core.admission import PromptTooLong
from engine.core.llm_engine import EngineConfig, LLMEngine
from engine.core.outputs import RequestOutput
from engine.model.loader import load_model
from engine.core.resume import Resume
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Two engines over one checkpoint: the first serves, the second takes over (as another worker would)."""
    model, tok = load_model(tiny_model_dir), Tokenizer(tiny_model_dir)
    pair = [LLMEngine(model, tok, EngineConfig(kv_cache_bytes=8 << 20, max_wait_ms=0)) for _ in range(2)]
    for e in pair:
        e.start()
    yield pair
    for e in pair:
        e.stop()


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, resume: Resume | None = None) -> list[RequestOutput]:
    outs: queue.Queue[RequestOutput] = queue.Queue()
    engine.submit(prompt, params, outs.put, resume=resume)
    got = []
    while not got or not got[-1].finished:
        got.append(outs.get(timeout=120))
    return got


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, ignore_eos=True),
    SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, top_p=0.9, seed=1234),
    SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, stop=["the pipe"]),  # unseeded, stop string
], ids=["greedy", "seeded", "unseeded-stop"])
@pytest.mark.parametrize("cut", [0, 1, 7, 23])
def test_resumed_request_continues_token_for_token(engines, tiny_model_dir, params, cut):
    first, second = engines
    prompt = Tokenizer(tiny_model_dir).encode("the pipeline moves weights and kernels")
    whole = run(first, prompt, params)
    tokens = [t for o in whole for t in o.token_ids]
    text = "".join(o.text for o in whole)
    if cut >= len(tokens):
        pytest.skip("this run finished before the cut")
    # what a client had after `cut` tokens: their ids, and the text deltas that came with them
    sent_tokens, sent_text, seen = [], "", 0
    for o in whole:
        if seen + len(o.token_ids) > cut:
            break
        seen += len(o.token_ids)
        sent_tokens += o.token_ids
        sent_text += o.text
    resumed = run(second, prompt, params, Resume(output_token_ids=sent_tokens, sent_chars=len(sent_text),
                                                 seed=whole[0].seed))
    assert sent_tokens + [t for o in resumed for t in o.token_ids] == tokens
    assert sent_text + "".join(o.text for o in resumed) == text
    assert resumed[-1].finish_reason == whole[-1].finish_reason
    assert (resumed[-1].prompt_tokens, resumed[-1].completion_tokens) == (whole[-1].prompt_tokens,
                                                                          whole[-1].completion_tokens)


def test_without_the_seed_an_unseeded_resume_draws_afresh(engines, tiny_model_dir):
    """The check above can fail: a resume that does not carry the first worker's seed samples differently."""
    first, second = engines
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0)
    prompt = Tokenizer(tiny_model_dir).encode("the pipeline moves weights and kernels")
    whole = run(first, prompt, params)
    tokens = [t for o in whole for t in o.token_ids]
    resumed = run(second, prompt, params, Resume(output_token_ids=tokens[:5], sent_chars=0))
    assert tokens[:5] + [t for o in resumed for t in o.token_ids] != tokens


def test_a_resume_with_nothing_left_to_generate_is_refused(engines):
    with pytest.raises(PromptTooLong, match="nothing is left to generate"):
        engines[0].check([1, 2, 3], SamplingParams(max_tokens=2), Resume(output_token_ids=[4, 5]))
