"""OpenAI request and response bodies (the subset tideflow serves), as pydantic models."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator

from engine.core.sampling import SamplingParams
from engine.tokenizer import ChatMessage, Text


# JSON types as OpenAI documents them: "false" is not a boolean and true is not a number (lax parsing streamed
# a "stream": "false" request and took max_tokens: true as 1).
Number = Annotated[float, Field(strict=True)]
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; a bigger id (2^63 overflowed the router's block hash) is a 400
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]

# OpenAI fields this server does not implement, with the value that means "not asked for": any other value is a
# 400 naming the field, never a 200 that silently means something else (a logit_bias that bans every token).
UNSERVED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": (None, {}), "best_of": (None, 1),
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

    # refused unless unset (UNSERVED_FIELDS); declared so that a refusal names its field
    logprobs: Any = Field(None, description="not served")
    top_logprobs: Any = Field(None, description="not served")
    logit_bias: Any = Field(None, description="not served")
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
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: Text | list[TokenId] | list[Text] = Field(description="text, token ids, or a list holding one text")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("batched prompts are not served: send one prompt per request")
            return v[0]
        return v


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="newer name of max_tokens")


def _same(value: Any, unset: Any) -> bool:
    """Equal and of the same JSON type (True == 1 in Python, not in JSON)."""
    return type(value) is type(unset) and value == unset


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
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
    logprobs: None = None
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
    logprobs: None = None
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
