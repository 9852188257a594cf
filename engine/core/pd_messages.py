"""What the router, a prefill worker and a decode worker send each other for one PD request (engine/core/pd.py moves
the KV itself). No torch: the router builds and forwards these without loading it."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, Field

from engine.core.resume import Resume
from engine.core.sampling_params import Logprob
from engine.encoder.prompt import PromptImage
from engine.transfer.base import TransferDescriptor


class HandoffResult(BaseModel):
    """What prefill returns; the router passes it to decode unchanged."""

    first_token: int
    descriptor: TransferDescriptor
    seed: int | None = Field(None, ge=-(2**63), lt=2**64,
                             description="what the request samples from (engine.core.sampling_params.step_uniform); None = greedy")
    num_cached_tokens: int = Field(0, ge=0, description="prompt tokens prefill found in its prefix cache")
    first_logprob: Logprob | None = Field(None, description="the first token's log-probabilities, when asked for")
    skipped_blocks: int = Field(0, ge=0, description="leading blocks not in the transfer: the decode worker takes "
                                                      "them from its own prefix cache")


class PrefillRequest(BaseModel):
    prompt_token_ids: list[int] = Field(min_length=1)
    request: dict = Field(description="the client's OpenAI request body (sampling fields)")
    images: list[PromptImage] = Field(default_factory=list, description="encoder output placed in the prompt")
    resume: Resume | None = Field(None, description="a migrated request: prefill covers prompt + these tokens")
    skip_blocks: int = Field(0, ge=0, description="leading blocks the decode worker holds: left out of the transfer "
                                                  "(at least the last block is always sent)")


class DecodeRequest(HandoffResult):
    api: str = Field(pattern="^(completions|chat/completions)$")
    request: dict
    prompt_token_ids: list[int] = Field(min_length=1)
    images: list[PromptImage] = Field(default_factory=list, description="encoder output placed in the prompt")
    resume: Resume | None = Field(None, description="a migrated request: what its client already received")


def new_transfer_id() -> str:
    return uuid.uuid4().hex
