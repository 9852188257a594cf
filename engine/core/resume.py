"""A request taken over mid-stream: what its client already has, so another worker goes on from there.

The router keeps, per streamed request, the prompt's token ids, every token id streamed and how many
characters of text the client received. When the worker serving it dies, another worker recomputes
prompt + those tokens (as after a preemption) and samples the next one; its text deltas start after
the characters already sent, so the client's stream goes on with no token lost or repeated.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class Resume(BaseModel):
    output_token_ids: list[int] = Field(default_factory=list, description="tokens the client already received")
    sent_chars: int = Field(0, ge=0, description="characters of text the client already received")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64,
                             description="the seed the first worker drew with (engine.core.sampling_params.resolve_seed)")

# The router asks a member for token ids with this header; the member then adds this field to every
# streamed chunk ({"token_ids", "seed"}; the first also "prompt_token_ids") and the router strips it.
TRACE_HEADER = "x-tideflow-trace"
TRACE_FIELD = "tideflow"


class ResumeRequest(BaseModel):
    """POST /internal/resume on a colocated member: the client's request, continued."""

    api: str = Field(pattern="^(completions|chat/completions)$")
    request: dict = Field(description="the client's OpenAI request body")
    prompt_token_ids: list[int] = Field(min_length=1)
    resume: Resume
