"""Prefill/decode disaggregation inside one engine: hand a prefilled sequence's KV to a decode worker.

The prefill engine computes the prompt, samples the first token, exports the prompt's KV blocks
into the transport's staging buffer and finishes the sequence (its blocks stay in the prefix
cache). The decode engine imports those bytes into fresh blocks and continues from the first
token, with the sampler's generator state carried over so seeded sampling is unchanged.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field

from engine.encoder.prompt import PromptImage
from engine.kv_cache import export_into, kv_nbytes
from engine.model.paged import KVCache
from engine.transfer import KVSender, TransferDescriptor


@dataclass
class Handoff:
    """Attached to a sequence that a decode worker continues."""

    sender: KVSender
    transfer_id: str


class HandoffResult(BaseModel):
    """What prefill returns; the router passes it to decode unchanged."""

    first_token: int
    descriptor: TransferDescriptor
    generator_state: str | None = Field(None, description="base64 torch.Generator state after the first token")
    num_cached_tokens: int = Field(0, ge=0, description="prompt tokens prefill found in its prefix cache")


class PrefillRequest(BaseModel):
    prompt_token_ids: list[int] = Field(min_length=1)
    request: dict = Field(description="the client's OpenAI request body (sampling fields)")
    images: list[PromptImage] = Field(default_factory=list, description="encoder output placed in the prompt")


class DecodeRequest(HandoffResult):
    api: str = Field(pattern="^(completions|chat/completions)$")
    request: dict
    prompt_token_ids: list[int] = Field(min_length=1)
    images: list[PromptImage] = Field(default_factory=list, description="encoder output placed in the prompt")


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def export_kv(kv_cache: KVCache, block_ids: list[int], handoff: Handoff) -> TransferDescriptor:
    """Copy the blocks straight into the sender's staging buffer, then seal it."""
    view = handoff.sender.stage(handoff.transfer_id, kv_nbytes(kv_cache, len(block_ids)))
    try:
        export_into(kv_cache, block_ids, view)
    except BaseException:
        view.release()
        handoff.sender.discard(handoff.transfer_id)
        raise
    view.release()
    return handoff.sender.commit(handoff.transfer_id)


def encode_generator(gen: torch.Generator | None) -> str | None:
    return None if gen is None else base64.b64encode(gen.get_state().numpy().tobytes()).decode()


def decode_generator(state: str | None) -> torch.Generator | None:
    if state is None:
        return None
    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
    return gen
