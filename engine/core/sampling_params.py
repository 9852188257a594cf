"""What a request asks of the sampler, on the host alone: its parameters, the limits the API checks them against,
and the keyed draws that let any worker sample what the first one would have. No torch here: the router and the
API servers validate requests with these without loading the sampler (engine/core/sampling.py)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API; vLLM's default cap too
MAX_LOGIT_BIAS = 1024  # entries per request: bounds the host work a request adds to every step it is in
PRIORITY_RANGE = (-(2**31), 2**31 - 1)


class SamplingParams(BaseModel):
    """How one request picks its tokens (temperature 0 means greedy), and when it runs: its priority rides with
    the parameters so that every path a request takes (the engine core's process, prefill -> decode, a
    migration) carries it."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, le=32768, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy; below 1e-4 it is greedy too")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="makes sampling reproducible per request (64 bits)")
    stop: list[str] = Field(default_factory=list, max_length=8, description="strings that end generation")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence tokens")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="report each token's log-probability with this many most likely "
                                             "alternatives; None = none")
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS, description="token id -> added to its logit before sampling")
    priority: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                          description="lower runs first (vLLM's convention), before the fair share between clients")
    cache_salt: str | None = Field(None, min_length=1, max_length=256,
                                   description="KV blocks are shared only between requests of the same salt (tenant "
                                               "isolation); it rides here so every path the request takes keeps it")


class Logprob(NamedTuple):
    """One generated token's log-probability and the most likely alternatives at its step, most likely first.

    From the distribution the token was drawn from: the logits with the request's bias, divided by its
    temperature (1 for a greedy request), before top-k and top-p cut it."""

    logprob: float
    top: list[tuple[int, float]]


# Below this a temperature scales logits past float range (inf / inf = NaN); the distribution it asks for
# is the argmax anyway, so it is served greedily.
GREEDY_BELOW = 1e-4


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def resolve_seed(params: SamplingParams) -> int | None:
    """The seed a sampled request draws from: its own, or a fresh one; None for greedy requests."""
    if is_greedy(params):
        return None
    return params.seed if params.seed is not None else secrets.randbits(63)


def step_uniform(seed: int, step: int) -> float:
    """The uniform draw in [0, 1) that picks output token number `step` of a request seeded with `seed`.

    Keyed by (seed, step) rather than carried along: any worker can draw token `step` without the
    state of the worker that drew the ones before. A decode worker continuing a prefill, or a worker
    taking over a request whose worker died, samples what the first worker would have. Computed on
    the host from the key alone, so every device draws the same number.
    """
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / 2.0**53
