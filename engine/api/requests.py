"""From an OpenAI request body to prompt token ids and sampling params, checked against the engine."""

from __future__ import annotations

import msgspec
from pydantic import ValidationError

from engine.core.sampling_params import SamplingParams
from engine.api.errors import APIError, clip, invalid
from engine.api.protocol import MAX_MESSAGES, ChatCompletionRequest, CompletionRequest
from engine.model.tokenizer import Tokenizer

Body = CompletionRequest | ChatCompletionRequest


def prompt_ids(tokenizer: Tokenizer, body: Body) -> list[int]:
    """Chat requests go through the chat template; completions take text or token ids."""
    if isinstance(body, ChatCompletionRequest):
        if any(m.image_urls for m in body.messages):
            raise APIError(400, "image content parts need a group with an encoder role (prefill + decode + encoder); "
                           "this deployment serves text only", param="messages", code="images_unsupported")
        return tokenizer.encode(tokenizer.apply_chat_template(body.messages))
    return tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)


def prompt_char_limit(tokenizer: Tokenizer, context_length: int) -> int:
    """The most characters `context_length` tokens can stand for: a token stands for no more characters than
    (twice) the vocabulary's longest entry (x2: a normalizer may compose characters, e + combining accent -> one)."""
    return 2 * context_length * tokenizer.longest_token_chars


def check_prompt_chars(body: Body, tokenizer: Tokenizer, context_length: int) -> None:
    """APIError 400 naming the limit when a prompt has more characters than prompt_char_limit, before anything
    tokenizes it: tokenizing a 7 MB prompt only to refuse it took both cores of a 2-core member for seconds, and
    its other clients with them."""
    limit = prompt_char_limit(tokenizer, context_length)
    chars = _prompt_chars(body)
    if chars > limit:
        raise APIError(400, f"the prompt's {chars} characters cannot fit the model's context of {context_length} "
                            f"tokens (at most {limit} characters)",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")


def _prompt_chars(body: Body) -> int:
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(getattr(p, "text", "")) for p in m.content)
                   for m in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0


def params_for(body: Body, prompt_len: int, engine) -> SamplingParams:
    """Sampling params of a request to `engine` (an LLMEngine or CoreClient: its context and vocabulary)."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or max(engine.max_model_len - prompt_len, 1)
    else:
        max_tokens = body.max_tokens or 16
    try:
        params = body.sampling_params(max_tokens)
    except ValidationError as exc:
        raise invalid(exc) from None
    outside = next((t for t in params.logit_bias if t >= engine.vocab_size), None)
    if outside is not None:
        raise APIError(400, f"logit_bias names token id {outside}, outside the vocabulary [0, {engine.vocab_size})",
                       param="logit_bias", code="invalid_value")
    return params


def check_priority(priority: int, floor: int | None) -> None:
    """APIError 403 when a request asks to go before what its API key may (ApiKey.priority_floor; None: any)."""
    if floor is not None and priority < floor:
        raise APIError(403, f"priority {priority} is more urgent than this API key may ask for (priority >= {floor}; "
                            "lower runs first)", param="priority", code="priority_not_allowed")


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"the model {clip(requested)} does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


def check_token_ids(prompt: list[int], vocab: int) -> None:
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt holds token id {bad}, outside the vocabulary [0, {vocab})", param="prompt",
                       code="invalid_value")


def prepare(engine, model_name: str, body: Body) -> tuple[list[int], SamplingParams]:
    """Prompt token ids and sampling params of a request to `engine` (an LLMEngine)."""
    check_model(body.model, model_name)
    check_prompt_chars(body, engine.tokenizer, engine.max_model_len)
    prompt = prompt_ids(engine.tokenizer, body)
    check_token_ids(prompt, engine.vocab_size)
    return prompt, params_for(body, len(prompt), engine)


class _ChatShape(msgspec.Struct, gc=False):
    messages: list[msgspec.Raw] = []


class _MessageShape(msgspec.Struct, gc=False):
    content: msgspec.Raw = msgspec.Raw()


_chat_shape, _message_shape = msgspec.json.Decoder(_ChatShape), msgspec.json.Decoder(_MessageShape)
_parts = msgspec.json.Decoder(list[msgspec.Raw])


def check_chat_size(raw: bytes) -> None:
    """APIError 400 when a chat body holds more messages, or content parts in all, than MAX_MESSAGES. Counted
    from the JSON bytes, before anything builds an object per message (10^5 messages: 12 ms here, where
    json.loads took 60 and pydantic 100 more, each in one call with the GIL held, and the full garbage collections
    those objects set off longer still). A body of another shape is left for validation to name its error."""
    try:
        messages = _chat_shape.decode(raw).messages
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages: at most {MAX_MESSAGES} messages are served, not {len(messages)}",
                       param="messages", code="invalid_value")
    parts = 0
    for message in messages:
        try:
            content = bytes(_message_shape.decode(message).content)
            parts += len(_parts.decode(content)) if content.startswith(b"[") else 0
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    if parts > MAX_MESSAGES:
        raise APIError(400, f"messages: at most {MAX_MESSAGES} content parts are served in all, not {parts}",
                       param="messages", code="invalid_value")


def parse_body(api: str, raw: dict) -> Body:
    """Validate a body that came as a plain dict (through the router's internal hop)."""
    model = ChatCompletionRequest if api == "chat/completions" else CompletionRequest
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise invalid(exc) from None
