"""Image content part -> vision embeddings -> splice -> a ModelRunner step of the tiny model."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image
from prometheus_client import CollectorRegistry

from engine.encoder.cache import EncoderCache
from engine.encoder.images import ImageError
from engine.encoder.vision import load_vision_encoder, write_vision_encoder
from engine.encoder.worker import EncoderWorker
from engine.runtime.errors import CheckpointError
from engine.model.loader import load_model
from engine.core.model_runner import ModelRunner, SeqStep
from engine.model.tokenizer import Tokenizer

PLACEHOLDER = 0


def data_url(color: tuple[int, int, int], fmt: str = "PNG", size=(40, 30)) -> str:
    img = Image.new("RGB", size, color)
    img.putpixel((3, 4), (255 - color[0], 0, 0))
    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    write_vision_encoder(tiny_model_dir, hidden_size=64, seed=3)
    model = load_model(tiny_model_dir)
    registry = CollectorRegistry()
    worker = EncoderWorker(load_vision_encoder(tiny_model_dir), EncoderCache(capacity=8, registry=registry))
    return model, Tokenizer(tiny_model_dir), worker, registry


def parts(url: str) -> list[dict]:
    return [{"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": " Answer briefly."}]


def run(model, prompt) -> torch.Tensor:
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    blocks = list(range((len(prompt.token_ids) + 15) // 16))
    return runner.step([SeqStep(prompt.token_ids, 0, blocks, prompt.embeds)])


def test_image_prompt_runs_end_to_end_and_the_image_matters(setup):
    model, tok, worker, _ = setup
    red = worker.prepare(parts(data_url((200, 10, 10))), tok.encode, model.embed, PLACEHOLDER)
    blue = worker.prepare(parts(data_url((10, 10, 200))), tok.encode, model.embed, PLACEHOLDER)
    span = red.images[0]
    assert span.length == worker.num_patches == 16
    assert red.token_ids[span.offset : span.offset + span.length] == [PLACEHOLDER] * 16
    assert red.token_ids == blue.token_ids and red.image_hashes != blue.image_hashes
    assert red.embeds.shape == (len(red.token_ids), 64)
    vectors, _ = worker.encode(data_url((200, 10, 10)))
    assert torch.equal(red.embeds[span.offset : span.offset + span.length], vectors)
    text_rows = torch.tensor(red.token_ids[: span.offset])
    assert torch.equal(red.embeds[: span.offset], model.embed(text_rows))
    logits_red, logits_blue = run(model, red), run(model, blue)
    assert logits_red.shape == (1, 512) and torch.isfinite(logits_red).all()
    assert (logits_red - logits_blue).abs().max() > 1e-4


def test_text_only_content_skips_the_encoder(setup):
    model, tok, worker, _ = setup
    misses = worker.cache.misses
    prompt = worker.prepare([{"type": "text", "text": "hello there"}], tok.encode, model.embed, PLACEHOLDER)
    assert prompt.embeds is None and prompt.images == [] and prompt.token_ids == tok.encode("hello there")
    assert worker.prepare("hello there", tok.encode, model.embed, PLACEHOLDER).token_ids == prompt.token_ids
    assert worker.cache.misses == misses


def test_the_same_image_twice_hits_the_cache(setup):
    model, tok, worker, registry = setup
    url = data_url((1, 2, 3))
    hits, misses = worker.cache.hits, worker.cache.misses
    first = worker.prepare(parts(url), tok.encode, model.embed, PLACEHOLDER)
    second = worker.prepare(parts(url), tok.encode, model.embed, PLACEHOLDER)
    assert (worker.cache.hits, worker.cache.misses) == (hits + 1, misses + 1)
    assert torch.equal(first.embeds, second.embeds)
    assert registry.get_sample_value("tideflow_encoder_cache_hits_total") == worker.cache.hits
    assert registry.get_sample_value("tideflow_encoder_cache_misses_total") == worker.cache.misses


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,iVBORw0KGgo!!!notbase64", "malformed base64"),
    ("data:image/png;base64," + base64.b64encode(b"just some text, no pixels here").decode(), "not an image"),
    ("https://example.com/cat.png", "must be a base64 data URL"),
    ("data:image/png,rawbytes", "not base64-encoded"),
])
def test_bad_images_give_clear_errors(setup, url, message):
    model, tok, worker, _ = setup
    with pytest.raises(ImageError, match=message) as info:
        worker.prepare(parts(url), tok.encode, model.embed, PLACEHOLDER)
    assert str(info.value).startswith("content[1]: ")


def test_truncated_image_and_unknown_part_type(setup):
    model, tok, worker, _ = setup
    raw = base64.b64decode(data_url((9, 9, 9)).split(",", 1)[1])
    truncated = "data:image/png;base64," + base64.b64encode(raw[: len(raw) // 2]).decode()
    with pytest.raises(ImageError, match="damaged image|not an image"):
        worker.encode(truncated)
    with pytest.raises(ImageError, match="type 'input_audio'"):
        worker.prepare([{"type": "input_audio"}], tok.encode, model.embed, PLACEHOLDER)


def test_missing_encoder_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(CheckpointError, match="write_vision_encoder"):
        load_vision_encoder(tmp_path)
