"""OpenAI request and response bodies (the subset tideflow serves), as pydantic models."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

from engine.core.sampling_params import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, PRIORITY_RANGE, SamplingParams
from engine.model.tokenizer import ChatMessage, Text


# JSON types as OpenAI documents them: "false" is not a boolean and true is not a number (lax parsing streamed
# a "stream": "false" request and took max_tokens: true as 1).
Number = Annotated[float, Field(strict=True)]
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; a bigger id (2^63 overflowed the router's block hash) is a 400
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
# Every chat message costs at least its role marker's tokens, so no conversation of more messages than this fits
# a context under it; the bound keeps one body from making 10^5 message objects (and the full garbage
# collections they set off, which hold every thread of the process, the event loop included). Validation stops
# at the first message past it.
MAX_MESSAGES = 8192

# OpenAI fields this server does not implement, with the value that means "not asked for": any other value is a
# 400 naming the field, never a 200 that silently means something else (a logit_bias that bans every token).
UNSERVED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    include_usage: StrictBool = Field(False, description="send a last chunk carrying usage counts")


class _GenerationFields(BaseModel):
    """Fields shared by completions and chat; unknown OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="id from /v1/models")
    max_tokens: StrictInt | None = Field(None, ge=1, description="most tokens to generate")
    temperature: Number = Field(1.0, ge=0.0, le=2.0, description="0 = greedy (below 1e-4 too)")
    top_p: Number = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: StrictInt = Field(0, ge=-1, description="extra: keep the k most likely tokens; 0 or -1 = all")
    n: StrictInt = Field(1, ge=1, le=1, description="choices per request: only 1 is served")
    stream: StrictBool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = Field(None, description="up to 8 strings that end generation")
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64, description="makes sampling reproducible (fits 64 bits)")
    ignore_eos: StrictBool = Field(False, description="extra: generate past end-of-sequence tokens")
    logit_bias: dict[str, Number] | None = Field(
        None, description=f"token id (as a string) -> bias in [-100, 100] added to its logit; at most {MAX_LOGIT_BIAS}")
    priority: StrictInt = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                                description="extra (vLLM's): lower runs first; no lower than the API key may ask for")
    cache_salt: Text | None = Field(None, min_length=1, max_length=256,
                                    description="extra (vLLM's): requests share cached KV only with the same salt")

    # refused unless unset (UNSERVED_FIELDS); declared so that a refusal names its field
    best_of: Any = Field(None, description="not served (n is 1)")
    echo: Any = Field(None, description="not served")
    suffix: Any = Field(None, description="not served")
    presence_penalty: Any = Field(None, description="not served")
    frequency_penalty: Any = Field(None, description="not served")
    tools: Any = Field(None, description="not served")
    tool_choice: Any = Field(None, description="not served")
    functions: Any = Field(None, description="not served")
    function_call: Any = Field(None, description="not served")
    response_format: Any = Field(None, description="not served")

    @field_validator(*UNSERVED_FIELDS)
    @classmethod
    def _unserved(cls, value: Any, info: ValidationInfo) -> None:
        if not any(_same(value, unset) for unset in UNSERVED_FIELDS[info.field_name]):
            raise ValueError("not implemented by this server; leave it out or send its default")
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
                raise ValueError(f"keys are token ids as strings of digits, not {key[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} is {bias}; biases lie in [-100, 100]")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 8:
            raise ValueError("at most 8 stop strings")
        return v

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, logprobs=self.top_logprob_count,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()}, priority=self.priority,
            cache_salt=self.cache_salt,
        )

    @property
    def top_logprob_count(self) -> int | None:
        """How many alternatives each token reports; None when the request wants no log-probabilities."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: Text | list[TokenId] | list[Text] = Field(description="text, token ids, or a list holding one text")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                       description="report each token's log-probability and this many alternatives")
    top_logprobs: Any = Field(None, description="a chat field: completions take the count in logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _chat_only(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("a chat completions field; the completions API takes the count in logprobs")
        return None

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not served: send one prompt per request")
            return v[0]
        return v


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, description="the conversation so far")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="newer name of max_tokens")
    logprobs: StrictBool | None = Field(None, description="report each token's log-probability")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                           description="alternatives reported per token; needs logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _same(value: Any, unset: Any) -> bool:
    """Equal and of the same JSON type (True == 1 in Python, not in JSON)."""
    return type(value) is type(unset) and value == unset


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV was reused (the KV cache or a tier below it), not "
                                           "computed")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt: int, completion: int, cached: int | None = None) -> Usage:
    """OpenAI's usage; `cached` where the answer's engine knows it (a member, not a router after a migration)."""
    details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=details)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class CompletionLogprobs(BaseModel):
    """The completions API's log-probabilities: lists with one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list, description="where each token starts in the generated text")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """The chat API's entry for one generated token."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tideflow"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
