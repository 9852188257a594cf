"""A simple batched generation loop over the model: the reference the serving engine must match."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.model.decoder import MoEForCausalLM
from engine.core.model_runner import ModelRunner, SeqStep
from engine.core.sampling import sample
from engine.core.sampling_params import SamplingParams, resolve_seed
from engine.core.stop import find_stop, finish_reason
from engine.model.tokenizer import Tokenizer


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class GenerationStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    generated: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated / self.decode_s if self.decode_s else 0.0


def generate(
    model: MoEForCausalLM,
    tokenizer: Tokenizer | None,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    block_size: int = 16,
    stats: GenerationStats | None = None,
) -> list[Completion]:
    """Prefill all prompts in one step, then decode the still-running ones together each step.

    Each sequence gets its own contiguous run of blocks, sized for prompt + max_tokens.
    """
    plist = params if isinstance(params, list) else [params] * len(prompts)
    need = [-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, plist)]
    runner = ModelRunner(model, num_blocks=sum(need), block_size=block_size)
    tables, first = [], 0
    for n in need:
        tables.append(list(range(first, first + n)))
        first += n
    eos = tuple(set(model.config.eos_ids) | set(tokenizer.eos_ids if tokenizer else ()))
    seeds = [resolve_seed(p) for p in plist]
    outs = [Completion(prompt_tokens=list(p)) for p in prompts]
    stats = stats if stats is not None else GenerationStats()

    t0 = time.perf_counter()
    logits = runner.step([SeqStep(list(p), 0, t) for p, t in zip(prompts, tables)])
    stats.prefill_s += time.perf_counter() - t0
    active = list(range(len(prompts)))
    while active:
        tokens = sample(logits, [plist[i] for i in active], [seeds[i] for i in active],
                        [len(outs[i].tokens) for i in active])
        still = []
        for i, (tok, _) in zip(active, tokens):
            if tok is None:
                raise ValueError(f"prompt {i}: sampling failed, the model gave no finite scores")
            out = outs[i]
            out.tokens.append(tok)
            if tokenizer is not None:
                out.text = tokenizer.decode(out.tokens)
            hit = bool(plist[i].stop) and find_stop(out.text, plist[i].stop) is not None
            out.finish_reason = finish_reason(tok, len(out.tokens), hit, plist[i], eos)
            if out.finish_reason is None:
                still.append(i)
            else:
                _trim(out, plist[i], tok, eos)
        active = still
        if not active:
            break
        t0 = time.perf_counter()
        logits = runner.step([
            SeqStep([outs[i].tokens[-1]], len(prompts[i]) + len(outs[i].tokens) - 1, tables[i]) for i in active
        ])
        stats.decode_s += time.perf_counter() - t0
        stats.decode_steps += 1
        stats.generated += len(active)
    return outs


def _trim(out: Completion, params: SamplingParams, token: int, eos: tuple[int, ...]) -> None:
    """Drop the EOS token and cut the text at a stop string, as the OpenAI API does."""
    if not params.ignore_eos and token in eos:
        out.tokens.pop()
    cut = find_stop(out.text, params.stop) if params.stop else None
    if cut is not None:
        out.text = out.text[:cut]
