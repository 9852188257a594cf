"""logprobs, top_logprobs and logit_bias through the official openai client: the numbers are transformers' for the
same tokens, streamed and whole answers carry the same entries, a bias steers the batched sampler, and bad values
are a 400 naming their field."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers

from engine.core.sampling_params import Logprob
from engine.server.logprobs import LogprobText
from engine.model.tokenizer import ChatMessage, Tokenizer
from tests.engine.server.conftest import API_KEY, MODEL

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

MESSAGES = [{"role": "user", "content": "tell me about tides"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """token ids -> transformers' log-softmax at every position (the reference for what follows each prefix)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)

    return logprobs


def chat_prompt(tiny_model_dir) -> list[int]:
    tok = Tokenizer(tiny_model_dir)
    return tok.encode(tok.apply_chat_template([ChatMessage.model_validate(m) for m in MESSAGES]))


def test_chat_logprobs_are_transformers_own_and_the_stream_carries_the_same(client, tiny_model_dir, hf_logprobs):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 6
    tok = Tokenizer(tiny_model_dir)
    ids = chat_prompt(tiny_model_dir)
    for entry in entries:  # transformers' greedy continuation, token by token
        top = torch.topk(hf_logprobs(ids)[-1], 4)
        ids.append(int(top.indices[0]))
        assert entry.bytes == list(tok.token_bytes(ids[-1]))
        assert [t.bytes for t in entry.top_logprobs] == [list(tok.token_bytes(t)) for t in top.indices.tolist()]
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, top.values.tolist())) < 1e-3
        assert abs(entry.logprob - top.values[0].item()) < 1e-3
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(stream=True, **args) if c.choices]
    again = [e for lp in streamed if lp for e in lp.content]
    # The same tokens and alternatives; the values equal to float rounding only: the second request reuses the
    # first one's cached prompt blocks, so its logits come from a step of another shape (on a CPU without AMX the
    # last digits differ)
    assert [(e.bytes, [t.bytes for t in e.top_logprobs]) for e in again] == \
        [(e.bytes, [t.bytes for t in e.top_logprobs]) for e in entries]
    assert max(abs(a.logprob - b.logprob) for x, y in zip(again, entries)
               for a, b in zip([x, *x.top_logprobs], [y, *y.top_logprobs])) < 1e-4


def test_completion_logprobs_are_lists_with_offsets_into_the_text(client):
    whole = client.completions.create(model=MODEL, prompt="the tide", max_tokens=5, temperature=0.8, seed=9,
                                      logprobs=2, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert all(v <= max(top.values()) + 1e-6 for v, top in zip(lp.token_logprobs, lp.top_logprobs))
    streamed = client.completions.create(model=MODEL, prompt="the tide", max_tokens=5, temperature=0.8, seed=9,
                                         logprobs=2, extra_body={"ignore_eos": True}, stream=True)
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt="the tide", max_tokens=5, temperature=0.8, seed=9,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == choice.text  # asking changes no token


def test_text_offsets_count_characters_when_tokens_split_them(tiny_model_dir):
    """Byte-level tokens split a multibyte character: each offset is the index of the character the token's first
    byte belongs to, in the decoded text (U+FFFD stand-ins are one character each and would push every later
    offset), and chunks of a stream give the offsets of the whole."""
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("tide é€ 🌊 ebb")
    raw = [tok.token_bytes(t) for t in ids]
    assert any(b and b[0] & 0xC0 == 0x80 for b in raw), "the test needs a token that begins mid-character"
    want = [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(ids))]
    text = LogprobText(tok)
    lps = [Logprob(-1.0, []) for _ in ids]
    whole = text.completion(ids, lps, 0)
    assert whole.text_offset == want
    assert text.chars(ids) == len(tok.decode(ids))
    head = text.completion(ids[:5], lps[:5], 0)
    tail = text.completion(ids[5:], lps[5:], text.chars(ids[:5]))
    assert head.text_offset + tail.text_offset == want


def test_a_worker_that_takes_a_request_over_counts_offsets_from_the_text_already_sent(server, tiny_model_dir):
    """The router migrates a request by handing its tokens to another worker: that worker's offsets run on from
    the end of their text (here two characters, one of them multibyte), as one worker's would."""
    tok = Tokenizer(tiny_model_dir)
    prompt, sent = tok.encode("the tide"), tok.encode(" é")
    request = dict(model=MODEL, prompt=prompt, max_tokens=len(sent) + 3, temperature=0, logprobs=1, ignore_eos=True)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        r = c.post("/internal/resume", json={"api": "completions", "request": request, "prompt_token_ids": prompt,
                                              "resume": {"output_token_ids": sent, "sent_chars": 2}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(sent) > len(tok.decode(sent)) == 2  # more tokens than characters: bytes split
    offsets = choice["logprobs"]["text_offset"]
    assert len(offsets) == 3 and offsets[0] == 2
    assert offsets == sorted(offsets) and offsets[-1] < 2 + len(choice["text"]), offsets


def test_a_bias_that_bans_every_token_but_one_leaves_that_one(client, tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    kept = tok.encode(" tide")[-1]
    bias = {str(t): -100 for t in range(tok.vocab_size) if t != kept}
    for temperature in (0, 1.0):
        got = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=temperature,
                                        logit_bias=bias, logprobs=1, extra_body={"ignore_eos": True})
        assert got.choices[0].text == tok.decode([kept] * 4)
        assert all(abs(v) < 1e-3 for v in got.choices[0].logprobs.token_logprobs)  # all the mass is on it
    favoured = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                                         logit_bias={str(kept): 100}, extra_body={"ignore_eos": True})
    assert favoured.choices[0].text == tok.decode([kept] * 3)


@pytest.mark.parametrize("api,extra,field", [
    ("completions", {"logit_bias": {"512": 1}}, "logit_bias"),  # the tiny vocabulary holds 512
    ("completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("completions", {"best_of": 2}, "best_of"),
])
def test_bad_values_are_a_400_naming_the_field(client, api, extra, field):
    with pytest.raises(openai.BadRequestError) as caught:
        if api == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body=extra)
    assert caught.value.body["param"].split(".")[0] == field, caught.value.body
