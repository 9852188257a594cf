"""Images through encoder -> prefill -> decode: the tokens of one engine given the spliced prompt, and the cache."""

from __future__ import annotations

import base64
import io
import queue

import httpx
import openai
import pytest
from PIL import Image
from pydantic import ValidationError

from engine.encoder.prompt import EncodedImage, block_extras, chat_prompt
from engine.encoder.splice import spliced_prompt
from engine.encoder.vision import load_vision_encoder
from engine.encoder.worker import EncoderWorker
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.core.kv_cache import BlockAllocator
from engine.core.llm_engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.api.errors import APIError
from engine.api.protocol import ChatCompletionRequest
from engine.api.requests import prompt_ids
from engine.model.tokenizer import ChatMessage, Tokenizer

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

MAX_TOKENS = 8


def data_url(color: tuple[int, int, int], size: int = 40) -> str:
    img = Image.new("RGB", (size, size), color)
    img.paste((255 - color[0], color[1] // 2, 255), (0, 0, size // 2, size // 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, BLUE = data_url((200, 30, 30)), data_url((20, 40, 220))


def chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is in this picture? "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " answer briefly"}]}]


def reference_text(model_dir, url: str) -> str:
    """One in-process engine given the spliced prompt: what the group must answer."""
    model, tok = load_model(model_dir), Tokenizer(model_dir)
    vectors, digest = EncoderWorker(load_vision_encoder(model_dir)).encode(url)
    messages = [ChatMessage.model_validate(m) for m in chat(url)]
    ids, placed = chat_prompt(tok, messages, [EncodedImage.of(vectors, digest)])
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_bytes=4_000_000, max_wait_ms=0))
    engine.start()
    try:
        outs: queue.Queue = queue.Queue()
        engine.submit(ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), outs.put,
                      images=spliced_prompt(ids, placed, model.embed))
        text = ""
        while True:
            out = outs.get(timeout=60)
            text += out.text
            if out.finished:
                assert out.error is None, out.error
                return text
    finally:
        engine.stop()


def encoder_spec(model_dir) -> InferenceGroup:
    engine = {"kv_cache_bytes": 4_000_000, "max_wait_ms": 0}
    return InferenceGroup.model_validate({
        "name": "mm", "version": "v1", "model": {"path": str(model_dir)},
        "roles": [{"role": "encoder"}, {"role": "prefill", "engine": engine}, {"role": "decode", "engine": engine}]})


def encoder_counter(group, groupset, name: str) -> float:
    url = next(m.endpoint for m in group.status.members if m.role == "encoder")
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {groupset.backend.api_key}"},
                     timeout=5, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def test_images_go_encoder_prefill_decode_and_repeat_images_hit_the_cache(groupset, tiny_model_dir):
    expected = {url: reference_text(tiny_model_dir, url) for url in (RED, BLUE)}
    assert expected[RED] != expected[BLUE]  # the embeddings, not just the placeholders, reach the model
    group = groupset.up(encoder_spec(tiny_model_dir))
    try:
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        client = openai.OpenAI(base_url=groupset.url + "/v1", api_key=groupset.client_key, max_retries=0, timeout=60)
        args = dict(model="default", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})

        first = client.chat.completions.create(messages=chat(RED), **args)
        assert first.usage.completion_tokens == MAX_TOKENS
        assert first.choices[0].message.content == expected[RED]
        assert encoder_counter(group, groupset, "tideflow_encoder_cache_misses_total") == 1
        assert encoder_counter(group, groupset, "tideflow_encoder_cache_hits_total") == 0

        stream = client.chat.completions.create(messages=chat(RED), stream=True, **args)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[RED]
        assert encoder_counter(group, groupset, "tideflow_encoder_cache_hits_total") == 1

        other = client.chat.completions.create(messages=chat(BLUE), **args)
        assert other.choices[0].message.content == expected[BLUE]  # same placeholders, no stale prefix blocks
        assert encoder_counter(group, groupset, "tideflow_encoder_cache_misses_total") == 2

        client.chat.completions.create(messages=[{"role": "user", "content": "text only"}], **args)
        assert encoder_counter(group, groupset, "tideflow_encoder_cache_misses_total") == 2  # skipped the stage

        with pytest.raises(openai.BadRequestError, match="images\\[0\\]"):
            client.chat.completions.create(messages=chat("data:image/png;base64,bm90IGFuIGltYWdl"), **args)
    finally:
        group.drain_and_stop(5)


def test_image_blocks_are_named_by_the_image_not_the_placeholders():
    allocator = BlockAllocator(8, 4)
    tokens = [7] * 13
    red = {i: b"red" for i in range(3)}
    first = Sequence("a", tokens, SamplingParams(max_tokens=1), block_extras=red)
    allocator.reserve(first, 13)
    first.num_computed = 12
    allocator.commit(first)
    same = Sequence("b", tokens, SamplingParams(max_tokens=1), block_extras=dict(red))
    assert allocator.match_prefix(same) == 12
    other = Sequence("c", tokens, SamplingParams(max_tokens=1), block_extras={i: b"blue" for i in range(3)})
    assert allocator.match_prefix(other) == 0


def test_block_extras_name_each_block_an_image_touches():
    from engine.encoder.prompt import ImageSpan

    extras = block_extras([ImageSpan(offset=3, length=6, content_hash="ab" * 32)], block_size=4)
    assert sorted(extras) == [0, 1, 2]
    assert len({extras[0], extras[1], extras[2]}) == 3  # the patch offset tells the blocks apart


def test_content_parts_validate_with_clear_errors(tiny_model_dir):
    body = {"model": "default", "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}
    with pytest.raises(ValidationError, match="text.*image_url|image_url.*text"):
        ChatCompletionRequest.model_validate(body)
    parts = ChatCompletionRequest.model_validate(
        {"model": "default", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    tok = Tokenizer(tiny_model_dir)
    plain = ChatCompletionRequest.model_validate({"model": "default", "messages": [{"role": "user", "content": "ab"}]})
    assert prompt_ids(tok, parts) == prompt_ids(tok, plain)
    with pytest.raises(APIError, match="encoder role") as err:
        prompt_ids(tok, ChatCompletionRequest.model_validate({"model": "default", "messages": chat(RED)}))
    assert err.value.status == 400
