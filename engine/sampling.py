"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """How one request picks its tokens; temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1, le=32768, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    seed: int | None = Field(None, description="makes sampling reproducible per request")
    stop: list[str] = Field(default_factory=list, max_length=8, description="strings that end generation")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence tokens")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of fp32 `logits` [B, vocab]."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for row, p, gen, g in zip(logits, params, generators, greedy):
        if p.temperature == 0.0:
            out.append(g)
            continue
        scores = row.cpu() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
