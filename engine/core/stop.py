"""Deciding when a sequence is finished: EOS, max tokens, stop strings."""

from __future__ import annotations

from engine.core.sampling_params import SamplingParams


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string begins, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def finish_reason(token: int, n_generated: int, stop_string_hit: bool, params: SamplingParams,
                  eos_ids: tuple[int, ...]) -> str | None:
    """'stop' (EOS, or a stop string: the text's verdict, engine.core.output_text), 'length' (max_tokens), or None
    to go on."""
    if (not params.ignore_eos and token in eos_ids) or stop_string_hit:
        return "stop"
    if n_generated >= params.max_tokens:
        return "length"
    return None
