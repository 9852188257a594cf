"""What a drill sends and when: synthetic prompts, JSONL traces, the arrival schedule (length laws: lengths.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, Field, ValidationError

if TYPE_CHECKING:
    from drills.spec import LoadDrillSpec

# Short, common English words: nearly one BPE token each, so N words approximate N tokens without a tokenizer.
VOCABULARY = (
    "the of and to in is for on that with as by at from it be this are or an was which not have but all can "
    "has more one were their will also its time two new first been other may into some most would so these "
    "over state city after when there only year such between during then any used many well under three "
    "where made part while both since before through high each work known same long early world about "
    "four day end back place life water name line open power group light field small order point case rate "
    "step load token model data cache node queue batch route graph price river stone cloud green north south"
).split()


class TraceEntry(BaseModel):
    """One line of a JSONL trace."""

    prompt: str = Field(description="text sent as the prompt")
    max_tokens: int = Field(ge=1, description="tokens asked for")
    arrival_s: float | None = Field(None, ge=0, description="seconds after drill start; None = scheduled by rate")


def load_trace(path: Path) -> list[TraceEntry]:
    entries = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append(TraceEntry.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as e:
            raise ValueError(f"trace {path} line {lineno}: {e}") from None
    if not entries:
        raise ValueError(f"trace {path} holds no requests")
    return entries


class PromptSynthesizer:
    """Random text of a requested token length; exact when a tokenizer is given, about right (one word/token) without."""

    def __init__(self, rng: np.random.Generator, tokenizer_dir: Path | None = None) -> None:
        self._rng = rng
        self._tok = None
        if tokenizer_dir is not None:
            from engine.model.tokenizer import Tokenizer

            self._tok = Tokenizer(tokenizer_dir)

    def make(self, n_tokens: int) -> tuple[str, int]:
        """Return (text, token count): the count is exact with a tokenizer, the word count without."""
        words = [VOCABULARY[i] for i in self._rng.integers(len(VOCABULARY), size=n_tokens)]
        if self._tok is None:
            return " ".join(words), n_tokens
        ids = self._tok.encode(" ".join(words))
        while len(ids) < n_tokens:
            ids += self._tok.encode(" " + " ".join(words))
        filler = self._tok.encode(" " + " ".join(words))
        # Decoding a cut and re-encoding can merge across the cut: trim or pad until the round trip is exact.
        ids = ids[:n_tokens]
        for _ in range(8):
            text = self._tok.decode(ids)
            again = self._tok.encode(text)
            if len(again) == n_tokens:
                break
            ids = (again + filler)[:n_tokens]
        return text, len(again)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the schedule: when it is due and what it asks."""

    step: int
    index: int
    arrival_s: float
    prompt: str
    prompt_tokens: int
    max_tokens: int


def step_arrivals(rng: np.random.Generator, rate: float, hold_s: float, law: str) -> np.ndarray:
    """Arrival offsets in [0, hold_s) for one step at `rate` req/s."""
    if law == "constant":
        return np.arange(math.ceil(rate * hold_s - 1e-9)) / rate
    # Poisson process: exponential gaps; draw generously, then cut at the hold.
    n = int(rate * hold_s + 6 * math.sqrt(rate * hold_s) + 10)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    while times[-1] < hold_s:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=n))])
    return times[times < hold_s]


def build_schedule(spec: LoadDrillSpec) -> tuple[list[PlannedRequest], list[float]]:
    """The whole drill's requests in arrival order, and the offered rate of each step; reproducible from spec.seed."""
    rng = np.random.default_rng(spec.seed)
    trace = load_trace(spec.trace) if spec.trace is not None else None
    rates = spec.step_rates
    if not rates:
        assert trace is not None  # the spec validator allows no rate only with a trace
        if any(e.arrival_s is None for e in trace):
            raise ValueError(f"trace {spec.trace}: without rate or steps every line needs arrival_s")
        span = max(e.arrival_s for e in trace) or 1.0
        plan = [PlannedRequest(0, i, e.arrival_s, e.prompt, len(e.prompt.split()), e.max_tokens)
                for i, e in enumerate(sorted(trace, key=lambda e: e.arrival_s))]
        return plan, [len(trace) / span]
    arrivals = [(k, k * spec.step_hold_s + t) for k, rate in enumerate(rates)
                for t in step_arrivals(rng, rate, spec.step_hold_s, spec.arrival)]
    n = len(arrivals)
    plan = []
    if trace is not None:
        for i, (k, t) in enumerate(arrivals):
            e = trace[i % len(trace)]
            plan.append(PlannedRequest(k, i, float(t), e.prompt, len(e.prompt.split()), e.max_tokens))
        return plan, rates
    prompt_lens = spec.prompt_len.sample(rng, n)
    output_lens = spec.output_len.sample(rng, n)
    synth = PromptSynthesizer(rng, spec.tokenizer_dir)
    for i, (k, t) in enumerate(arrivals):
        text, n_tok = synth.make(int(prompt_lens[i]))
        plan.append(PlannedRequest(k, i, float(t), text, n_tok, int(output_lens[i])))
    return plan, rates
