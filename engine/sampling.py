"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import hashlib
import secrets

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one request picks its tokens; temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, le=32768, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy; below 1e-4 it is greedy too")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="makes sampling reproducible per request (64 bits)")
    stop: list[str] = Field(default_factory=list, max_length=8, description="strings that end generation")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence tokens")


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


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator that draws output token number `step` of a request seeded with `seed`.

    Keyed by (seed, step) rather than carried along: any worker can draw token `step` without the
    state of the worker that drew the ones before. A decode worker continuing a prefill, or a worker
    taking over a request whose worker died, samples what the first worker would have.
    """
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little"))
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None],
           steps: list[int]) -> list[int | None]:
    """One token per row of fp32 `logits` [B, vocab]; None for a row with no valid distribution (its
    logits are not finite), so that request fails alone and the rest of the batch goes on.
    `seeds[i]` (from resolve_seed) and `steps[i]` (tokens row i generated so far) pick its draw."""
    # Every row's argmax and whether its logit is finite, brought to the host in one transfer: a per-row check
    # is one device sync per stream on a GPU (32 of a 32-stream step's ~39 syncs).
    argmax = logits.argmax(dim=-1)
    finite = torch.isfinite(logits.gather(1, argmax.unsqueeze(1)).squeeze(1))
    greedy, valid = torch.stack([argmax, finite.to(argmax.dtype)]).tolist()
    out: list[int | None] = []
    for row, p, seed, step, g, ok in zip(logits, params, seeds, steps, greedy, valid):
        if is_greedy(p):
            out.append(g if ok else None)
            continue
        probs = _distribution(row.cpu(), p)
        gen = step_generator(seed, step)
        out.append(int(torch.multinomial(probs, 1, generator=gen)) if probs is not None else None)
    return out


def _distribution(row: torch.Tensor, p: SamplingParams) -> torch.Tensor | None:
    scores = row / p.temperature
    if p.top_k:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep[0] = True  # the most likely token always stays, however small top_p is (even below fp32's range)
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    total = float(probs.sum())
    if not (total > 0.0 and torch.isfinite(probs).all()):
        return None
    return probs
