"""Prompts with images across processes: the wire form of embeddings and where they sit in the prompt.

The router renders the chat template with a marker per image, tokenizes the text between markers
and puts `num_patches` placeholder ids where each image goes; prefill and decode rebuild the
spliced prompt (engine.encoder.splice) from those ids and the embeddings. The image content
hashes are folded into the prefix-cache block hashes, since every image has the same placeholders.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

from engine.model.tokenizer import ChatMessage, Tokenizer

if TYPE_CHECKING:  # the router reads and places images without torch; the engine side is engine/encoder/splice.py
    import torch

IMAGE_MARKER = "\ue000image\ue000"  # private-use characters: no text a user sends renders as this
PLACEHOLDER_TOKEN = "<|endoftext|>"
VISION_SUBDIR = "vision_encoder"  # a checkpoint's vision encoder (engine/encoder/vision.py), also sized by the planner


@dataclass
class ImageSpan:
    offset: int  # first prompt position of the image
    length: int  # num_patches
    content_hash: str


class EncodedImage(BaseModel):
    """One image's embeddings as the encoder role answers them."""

    hash: str = Field(pattern="^[0-9a-f]{64}$", description="sha256 content hash of the decoded pixels")
    shape: tuple[int, int] = Field(description="[num_patches, hidden]")
    data: str = Field(description="base64 of the float32 embeddings, row major")

    @classmethod
    def of(cls, vectors: torch.Tensor, digest: str) -> "EncodedImage":
        raw = vectors.detach().float().contiguous().cpu().numpy().tobytes()
        return cls(hash=digest, shape=tuple(vectors.shape), data=base64.b64encode(raw).decode())


class PromptImage(BaseModel):
    """An image placed in a prompt: its embeddings start at prompt position `offset`."""

    offset: int = Field(ge=0, description="first prompt position of the image's placeholders")
    image: EncodedImage


def image_urls(messages: list[ChatMessage]) -> list[str]:
    return [url for m in messages for url in m.image_urls]


def placeholder_id(tokenizer: Tokenizer) -> int:
    found = tokenizer.token_id(PLACEHOLDER_TOKEN)
    return 0 if found is None else found


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], images: list[EncodedImage]) -> tuple[list[int], list[PromptImage]]:
    """Token ids of a chat with images (num_patches placeholders each) and where each image sits."""
    pieces = tokenizer.apply_chat_template(messages, image_marker=IMAGE_MARKER).split(IMAGE_MARKER)
    if len(pieces) != len(images) + 1:
        raise ValueError(f"the chat holds {len(pieces) - 1} image parts but {len(images)} embeddings were given")
    ids: list[int] = []
    placed: list[PromptImage] = []
    fill = placeholder_id(tokenizer)
    for text, image in zip(pieces, [*images, None]):
        ids.extend(tokenizer.encode(text) if text else [])
        if image is not None:
            placed.append(PromptImage(offset=len(ids), image=image))
            ids.extend([fill] * image.shape[0])
    return ids, placed


def block_extras(images: list[ImageSpan], block_size: int) -> dict[int, bytes]:
    """Block index -> bytes to fold into that block's hash: the hash and patch offset of each image in it."""
    extras: dict[int, bytes] = {}
    for span in images:
        first, last = span.offset // block_size, (span.offset + span.length - 1) // block_size
        for block in range(first, last + 1):
            start = max(block * block_size, span.offset) - span.offset
            extras[block] = extras.get(block, b"") + bytes.fromhex(span.content_hash) + start.to_bytes(4, "little")
    return extras
