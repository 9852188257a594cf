"""The encoder worker: turns a message's content parts into a spliced prompt, skipping work it has seen."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.encoder.cache import EncoderCache, content_hash
from engine.encoder.images import ImageError, decode_data_url, image_url_of, load_pixels
from engine.encoder.splice import SplicedPrompt, splice
from engine.encoder.vision import VisionEncoder


class EncoderWorker:
    """Vision encoder + content-hash cache; text-only content never touches the encoder."""

    def __init__(self, encoder: VisionEncoder, cache: EncoderCache | None = None) -> None:
        self.encoder = encoder
        self.cache = cache if cache is not None else EncoderCache()
        self.device = encoder.out.weight.device

    @property
    def num_patches(self) -> int:
        return self.encoder.config.num_patches

    def encode(self, url: str) -> tuple[torch.Tensor, str]:
        """(embeddings [num_patches, hidden], content hash) for one base64 data URL."""
        pixels = load_pixels(decode_data_url(url), self.encoder.config.image_size)
        digest = content_hash(pixels)
        vectors = self.cache.get_or_compute(digest, lambda: self.encoder(pixels.unsqueeze(0).to(self.device))[0])
        return vectors, digest

    def prepare(self, content: str | list[dict], tokenize: Callable[[str], list[int]], embed: nn.Embedding,
                placeholder_id: int) -> SplicedPrompt:
        """Token ids (+ embeds when images are present) for OpenAI message content (a string or parts)."""
        if isinstance(content, str):
            return SplicedPrompt(tokenize(content), None)
        segments: list = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                segments.append(tokenize(part.get("text", "")))
            elif kind == "image_url":
                try:
                    segments.append(self.encode(image_url_of(part)))
                except ImageError as exc:
                    raise ImageError(f"content[{i}]: {exc}") from None
            else:
                raise ImageError(f"content[{i}] has type {kind!r}; supported: 'text', 'image_url'")
        return splice(segments, embed, placeholder_id)
