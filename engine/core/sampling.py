"""The sampler: logit bias, greedy, temperature, top-k, top-p, seeded per request, and the log-probabilities a
request asks for, the whole batch on its device. What a request asks for lives in engine/core/sampling_params.py."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from engine.core.sampling_params import Logprob, SamplingParams, is_greedy, step_uniform
from engine.runtime.device import to_device


LOGPROB_FLOOR = -9999.0  # what a log-probability of zero probability (or a non-finite one) is reported as: JSON has no -inf


class Sampled(NamedTuple):
    """One row's outcome: its token, None when the row had no valid distribution; its Logprob when asked for."""

    token: int | None
    logprob: Logprob | None


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None],
           steps: list[int]) -> list[Sampled]:
    """One token per row of fp32 `logits` [B, vocab], with its log-probabilities when the row's request asks;
    token None for a row with no valid distribution (its logits are not finite), so that request fails alone
    and the rest of the batch goes on. `seeds[i]` (from resolve_seed) and `steps[i]` (tokens row i generated so
    far) pick its draw.

    The whole batch is sampled on the logits' device and everything the host needs (ids, validity,
    log-probabilities) comes to it in one transfer: a per-row check or draw is one device sync per stream on a GPU.
    """
    device = logits.device
    logits = _biased(logits, params)
    picked = logits.argmax(dim=-1)
    valid = torch.isfinite(logits.gather(1, picked.unsqueeze(1)).squeeze(1))
    rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if rows:
        drawn, drawn_valid = _draw(logits, [params[i] for i in rows],
                                   [step_uniform(seeds[i], steps[i]) for i in rows], rows)
        index = to_device(rows, torch.int64, device)
        picked = picked.index_copy(0, index, drawn)
        valid = valid.index_copy(0, index, drawn_valid)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    parts = [picked.double(), valid.double()]
    if wanted:
        parts += _logprobs(logits, picked, [params[i] for i in wanted], wanted)
    host = torch.cat(parts).tolist()
    n = len(params)
    ids, ok = host[:n], host[n : 2 * n]
    out = [Sampled(int(i) if good else None, None) for i, good in zip(ids, ok)]
    if wanted:
        k = min(max(params[i].logprobs for i in wanted), logits.shape[1])
        chosen, top = host[2 * n : 2 * n + len(wanted)], host[2 * n + len(wanted):]
        values, indices = top[: len(wanted) * k], top[len(wanted) * k :]
        for j, row in enumerate(wanted):
            alternatives = [(int(indices[j * k + a]), _reported(values[j * k + a])) for a in range(min(params[row].logprobs, k))]
            out[row] = out[row]._replace(logprob=Logprob(_reported(chosen[j]), alternatives))
    return out


def _biased(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` with each row's logit_bias added (a new tensor; the input unchanged when no row has a bias).
    Ids past the vocabulary are skipped here: the servers refuse them with a 400 before they reach a batch."""
    vocab = logits.shape[1]
    rows, ids, bias = [], [], []
    for i, p in enumerate(params):
        for token, value in p.logit_bias.items():
            if token < vocab:
                rows.append(i)
                ids.append(token)
                bias.append(value)
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, torch.int64, device), to_device(ids, torch.int64, device))
    return logits.index_put(index, to_device(bias, logits.dtype, device), accumulate=True)


def _logprobs(logits: torch.Tensor, picked: torch.Tensor, params: list[SamplingParams],
              rows: list[int]) -> list[torch.Tensor]:
    """For the `rows` that ask: the picked token's log-probability, then the top-k values and ids (k the largest
    any of them asks for), flat, as float64 for the one host transfer (ids below 2^53 are exact in it)."""
    device = logits.device
    index = to_device(rows, torch.int64, device)
    temperature = [1.0 if is_greedy(p) else p.temperature for p in params]
    scores = logits.index_select(0, index) / to_device(temperature, torch.float32, device).unsqueeze(1)
    logp = torch.log_softmax(scores.float(), dim=1)
    chosen = logp.gather(1, picked.index_select(0, index).unsqueeze(1)).squeeze(1)
    k = max(p.logprobs for p in params)
    if k == 0:
        return [chosen.double()]
    top = torch.topk(logp, min(k, logp.shape[1]), dim=1)
    return [chosen.double(), top.values.double().flatten(), top.indices.double().flatten()]


def _reported(value: float) -> float:
    """A log-probability as JSON can carry it: zero probability (and anything not finite) as LOGPROB_FLOOR."""
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def _draw(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float],
          rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws for the sampled `rows` of `logits`, all on its device: temperature, then top-k,
    then top-p, then the token where the row's cumulative probability passes its uniform draw."""
    device = logits.device
    scores = logits.index_select(0, to_device(rows, torch.int64, device))
    scores = scores / to_device([p.temperature for p in params], torch.float32, device).unsqueeze(1)
    vocab = scores.shape[1]
    top_k = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
    if min(top_k) < vocab:
        best = torch.topk(scores, max(top_k), dim=1).values
        kth = best.gather(1, to_device([k - 1 for k in top_k], torch.int64, device).unsqueeze(1))
        scores = scores.masked_fill(scores < kth, float("-inf"))  # a score tied with the k-th stays
    probs = torch.softmax(scores, dim=1)
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        sorted_p, order = torch.sort(probs, dim=1, descending=True)
        keep = sorted_p.cumsum(1) - sorted_p < to_device(top_p, torch.float32, device).unsqueeze(1)
        keep[:, 0] = True  # the most likely token always stays, however small top_p is (even below fp32's range)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
    cdf = probs.double().cumsum(1)
    total = cdf[:, -1]
    valid = torch.isfinite(probs).all(dim=1) & (total > 0)
    target = to_device(uniforms, torch.float64, device) * total
    drawn = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=vocab - 1)
    return drawn, valid

