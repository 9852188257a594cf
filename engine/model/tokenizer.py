"""Tokenizer from `tokenizer.json` (HF `tokenizers`), chat template, incremental detokenisation."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from typing import Annotated, Literal

import jinja2.sandbox
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from engine.runtime.errors import CheckpointError

# One prompt per call gains nothing from the library's thread pool, which would take cores the engine is pinned to,
# and a process that forks after using it gets a warning and loses it anyway (set it to override).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ChatML: the template used when a checkpoint ships none.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _encodable(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800") that no tokenizer can encode: refused at the boundary."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {exc.reason} at position {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class TextPart(BaseModel):
    """An OpenAI text content part."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text = Field(description="the text")


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, description="a base64 data URL: data:image/png;base64,...")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted for compatibility; ignored")


class ImagePart(BaseModel):
    """An OpenAI image content part; the encoder role turns it into embeddings."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageURL = Field(description="where the image is")


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    role: str = Field(pattern="^(system|user|assistant|tool)$", description="who speaks")
    content: Text | list[ContentPart] = Field(description="text of the message, or OpenAI content parts (text, image_url)")

    @property
    def image_urls(self) -> list[str]:
        return [] if isinstance(self.content, str) else [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def text(self, image_marker: str | None = None) -> str:
        """The content as one string; each image part becomes `image_marker` (ValueError without one)."""
        if isinstance(self.content, str):
            return self.content
        if image_marker is None and self.image_urls:
            raise ValueError("the message has image parts and nothing to place them with")
        return "".join(p.text if isinstance(p, TextPart) else image_marker for p in self.content)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception subclass, with a multi-line message
            raise CheckpointError(f"{path} is not a tokenizer the tokenizers library reads: "
                                  f"{' '.join(str(exc).split())[:200]}") from None
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"{cfg_path} is not readable JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path} must hold a JSON object, not {type(cfg).__name__}")
        template = cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise CheckpointError(f"{cfg_path}: chat_template does not parse: {exc}") from None
        self._special = {"bos_token": cfg.get("bos_token", ""), "eos_token": cfg.get("eos_token", "")}
        eos = cfg.get("eos_token")
        eos_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None
        self.eos_ids: tuple[int, ...] = (eos_id,) if eos_id is not None else ()
        self._special_ids = frozenset(self._tok.get_added_tokens_decoder())
        # this tokenizer's own cache of token bytes (a class-wide lru_cache would key on self and keep every
        # Tokenizer alive)
        self.token_bytes = functools.lru_cache(maxsize=65536)(self.token_bytes)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (byte-level entries: one per byte, so never fewer than the
        text a token stands for): a prompt of n characters is at least n / this many tokens."""
        return max((len(entry) for entry in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. a special token), None when absent."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: 1.9 s for a 750 KB prompt, which froze
        # the event loop of the process whatever thread it ran on)
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as the logprobs' `bytes` field reports them: a byte-level token may hold
        part of a character, which decode() renders as U+FFFD. A special token is its own text."""
        entry = self._tok.id_to_token(token_id)
        if entry is None:
            return b""
        if token_id in self._special_ids or not isinstance(self._tok.decoder, decoders.ByteLevel):
            return (self._tok.decode([token_id], skip_special_tokens=False) or entry).encode()
        if all(ch in _BYTE_OF_CHAR for ch in entry):
            return bytes(_BYTE_OF_CHAR[ch] for ch in entry)
        return entry.encode()

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            image_marker: str | None = None) -> str:
        """The prompt text; image parts render as `image_marker` (engine.encoder.prompt splits on it)."""
        return self._template.render(
            messages=[{"role": m.role, "content": m.text(image_marker)} for m in messages],
            add_generation_prompt=add_generation_prompt, **self._special
        )


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable bytes stand for themselves, the other bytes for the code
    points from 256 up, in byte order. Inverted: which byte each vocabulary character is."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()


class IncrementalDecoder:
    """Turns a growing token list into text deltas without splitting multi-byte characters.

    Each token decodes a short window (the last few tokens already turned into text, then the new ones) rather
    than every token so far: a whole-list decode per token costs O(n) per token, 0.7 ms at 1,024 tokens, on the
    thread that runs the model steps. The window's first tokens are decoded twice and their text subtracted, so a
    tokenizer whose decoding of a token depends on its left neighbour (a leading space dropped at the start)
    gives the text a whole decode gives.
    """

    WINDOW = 5  # tokens of already-decoded context before the new ones

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # where the decode window starts
        self._read = 0  # ids before this are in `text`

    def prime(self, tokens: list[int]) -> None:
        """Start from tokens already streamed (a resumed request): one decode instead of one per token.
        Text stops before a trailing incomplete character, as `push` would have left it."""
        self.ids = list(tokens)
        read = len(self.ids)
        text = self.tokenizer.decode(self.ids)
        while read and text.endswith("\ufffd"):  # its bytes go on in the next token: leave it unread
            read -= 1
            text = self.tokenizer.decode(self.ids[:read])
        self.text, self._read, self._prefix = text, read, max(0, read - self.WINDOW)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        window = self.tokenizer.decode(self.ids[self._prefix :])
        if window.endswith("\ufffd") or len(window) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait for the next token
        delta = window[len(before) :]
        self.text += delta
        self._read = len(self.ids)
        self._prefix = max(0, self._read - self.WINDOW)
        return delta
