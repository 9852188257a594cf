"""The router's encoder stage: which requests carry images, and their prompt once the encoder answered.

Only chat requests with `image_url` parts go through the encoder LB; the prompt prefill and decode
get is the chat template with `num_patches` placeholder ids per image (engine.encoder.prompt).
"""

from __future__ import annotations

from pathlib import Path

from engine.encoder.prompt import EncodedImage, ImageSpan, PromptImage, block_extras, chat_prompt, image_urls
from engine.api.errors import APIError
from engine.api.protocol import ChatCompletionRequest
from engine.api.requests import parse_body
from engine.model.tokenizer import Tokenizer


class ImagePrompts:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer(model_dir)

    @staticmethod
    def urls(api: str, body: dict, raw: bytes) -> list[str]:
        """The request's image data URLs in prompt order ([] for text-only requests, at no parsing cost)."""
        if api != "chat/completions" or b"image_url" not in raw:
            return []
        parsed = parse_body(api, body)
        assert isinstance(parsed, ChatCompletionRequest)
        return image_urls(parsed.messages)

    def prompt(self, body: dict, encoded: list[dict], block_size: int) -> tuple[list[int], list[PromptImage], dict[int, bytes]]:
        """Token ids, placed images and the block-hash extras of a chat whose images the encoder answered."""
        parsed = parse_body("chat/completions", body)
        try:
            images = [EncodedImage.model_validate(e) for e in encoded]
            ids, placed = chat_prompt(self.tokenizer, parsed.messages, images)
        except ValueError as exc:
            raise APIError(502, f"the encoder's answer does not fit the request: {exc}", code="encoder_mismatch") from None
        spans = [ImageSpan(p.offset, p.image.shape[0], p.image.hash) for p in placed]
        return ids, placed, block_extras(spans, block_size)
