"""Tokenizer round trips, the chat template, incremental decoding."""

from __future__ import annotations

import json

from engine.tokenizer import ChatMessage, IncrementalDecoder, Tokenizer


def test_round_trip_and_vocab(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    text = "Prefill and decode run as separate workers — ünïcode too."
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 512
    assert len(tok.encode("the the the")) < len("the the the")


def test_default_chat_template_is_chatml(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    prompt = tok.apply_chat_template([ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")])
    assert prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_checkpoint_chat_template_wins(tiny_model_dir, tmp_path):
    for f in ("tokenizer.json", "config.json"):
        (tmp_path / f).write_bytes((tiny_model_dir / f).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    assert Tokenizer(tmp_path).apply_chat_template([ChatMessage(role="user", content="x")]) == "[user]x"


def test_incremental_decoder_rebuilds_text(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    text = "naïve café — 東京"
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push(t) for t in tok.encode(text)) == text
