"""What the engine refuses before a request enters it, and how the servers answer each refusal: one check of a
request's size against the context (the engine on a thread and an engine core's API server both run it, so a
refusal reads the same from either) and the errors it raises."""

from __future__ import annotations

from engine.core.resume import Resume
from engine.core.sampling_params import SamplingParams
from engine.runtime.errors import TideflowError


class EngineError(TideflowError):
    """A request the engine refuses; `status` is the HTTP status the server answers with."""

    status = 400
    param: str | None = None
    code = "engine_refused"  # OpenAI-style, snake_case: what a client's code matches on


class PromptTooLong(EngineError):
    param = "prompt"
    code = "context_length_exceeded"  # as the size check before tokenizing says it (engine/api/requests.py)


class QueueFull(EngineError):
    status = 429
    code = "queue_full"


def check_request(prompt_tokens: list[int], params: SamplingParams, max_model_len: int,
                  resume: Resume | None = None) -> None:
    """Raise PromptTooLong if the request cannot fit the context or the KV cache, or (resumed) if nothing is left
    to generate."""
    if not prompt_tokens:
        raise PromptTooLong("the prompt is empty")
    total = len(prompt_tokens) + params.max_tokens
    if total > max_model_len:
        raise PromptTooLong(
            f"prompt ({len(prompt_tokens)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"the model's context of {max_model_len} tokens; shorten the prompt or lower max_tokens"
        )
    if resume is not None and len(resume.output_token_ids) >= params.max_tokens:
        raise PromptTooLong(f"the resumed request already holds {len(resume.output_token_ids)} of its "
                            f"{params.max_tokens} tokens: nothing is left to generate")
