"""Tokenizer round trips, the chat template, incremental decoding."""

from __future__ import annotations

import json

from engine.model.tokenizer import ChatMessage, IncrementalDecoder, Tokenizer


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


def test_incremental_text_equals_a_whole_decode_at_every_token_and_after_a_resume(tiny_model_dir):
    """The decoder reads a short window per token; its text must still be what decoding every token gives,
    through multi-byte characters split across tokens, special tokens (skipped) and a resume mid-character."""
    tok = Tokenizer(tiny_model_dir)
    ids = tok.encode("naïve café — 東京 tower, 🌊 tides; " * 6)
    eos = tok.token_id("<|endoftext|>")
    ids = ids[:20] + [eos] + ids[20:]
    dec = IncrementalDecoder(tok)
    for n, t in enumerate(ids, 1):
        dec.push(t)
        assert dec.text == tok.decode(ids[:n]).rstrip("\ufffd")
    split = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))  # mid-character
    resumed = IncrementalDecoder(tok)
    resumed.prime(ids[:split])
    rest = "".join(resumed.push(t) for t in ids[split:])
    assert resumed.text == tok.decode(ids) and resumed.text.endswith(rest)
