"""OpenAI request and response bodies (the subset tideflow serves), as pydantic models."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.core.sampling import SamplingParams
from engine.tokenizer import ChatMessage, Text


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="send a last chunk carrying usage counts")


class _GenerationFields(BaseModel):
    """Fields shared by completions and chat; unknown OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="id from /v1/models")
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy (below 1e-4 too)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    top_k: int = Field(0, ge=-1, description="extra: keep the k most likely tokens; 0 or -1 = all")
    n: int = Field(1, ge=1, le=1, description="choices per request: only 1 is served")
    stream: bool = Field(False, description="answer with server-sent events")
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = Field(None, description="up to 8 strings that end generation")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="makes sampling reproducible (fits 64 bits)")
    ignore_eos: bool = Field(False, description="extra: generate past end-of-sequence tokens")

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
    prompt: Text | list[int] | list[Text] = Field(description="text, token ids, or a list holding one text")

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
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens")


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
