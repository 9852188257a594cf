"""One client request as the router relays it: what the client got so far, enough to resume it elsewhere.

The router always streams from its upstream, with token ids traced (engine.core.resume.TRACE_HEADER), and
keeps here the prompt's token ids, the seed, every token id relayed and the characters of text sent.
When the upstream breaks mid-stream, `resume()` is what another worker needs to go on from exactly
there; the events of the new upstream pass through `take` like the first's, so the client sees one
stream (one id, one role chunk, usage counted over the whole request). A client that asked for no
stream gets the assembled answer (`answer()`), so it is migrated the same way.
"""

from __future__ import annotations

import json
import time

from opentelemetry.trace import SpanContext

from engine.core.resume import TRACE_FIELD, Resume
from engine.api.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs, ChatMessageOut, CompletionChoice,
    CompletionLogprobs, CompletionResponse, Usage, usage,
)


class UpstreamBroke(Exception):
    """The upstream stream cannot go on: an error event, or an end before the request finished."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class StreamRecord:
    def __init__(self, api: str, body: dict, t0: float) -> None:
        self.api, self.model = api, body.get("model", "")
        self.client_stream = bool(body.get("stream"))
        self.client_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chat = api == "chat/completions"
        self.wants_logprobs = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        self.chat_logprobs: list[dict] = []  # the chat API's entries so far, for a client that asked for no stream
        self.completion_logprobs = CompletionLogprobs()  # the completions API's lists so far (no-stream client)
        self.t0 = t0
        self.first: float | None = None  # when the first text reached the client
        self.end: float | None = None
        self.prompt_ids: list[int] | None = None
        self.block_hashes: list[int] = []  # of prompt_ids, for prefix affinity (disaggregated groups)
        self.client = ""  # who asked (engine.api.auth.key_digest): members share their engines by it
        self.image_urls: list[str] = []  # the client's images (disaggregated groups encode them)
        self.images: list[dict] = []  # those images placed in the prompt (engine.encoder.prompt.PromptImage)
        self.extras: dict[int, bytes] = {}  # block index -> image hashes, for prefix-affinity block names
        self.seed: int | None = None
        self.token_ids: list[int] = []
        self.sent_chars = 0
        self.parts: list[str] = []
        self.id: str | None = None
        self.created: int | None = None
        self.role_sent = False
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.usage_sent = False
        self.done = False  # the upstream said [DONE]
        self.started = False  # some upstream's first event was taken: a new upstream resumes
        self.broken: SpanContext | None = None  # the trace span of the stream that broke last (a resume links it)

    # ---- what comes in ----------------------------------------------------------------------------
    def take(self, line: str) -> str | None:
        """One upstream SSE line -> the event to relay to a streaming client (JSON text), or None."""
        if not line.startswith("data:"):
            return None
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return None
        try:
            event = json.loads(payload)
        except ValueError:
            raise UpstreamBroke("bad_event", f"the upstream sent an event that is not JSON: {payload[:200]}") from None
        if not isinstance(event, dict):
            raise UpstreamBroke("bad_event", f"the upstream sent an event that is not an object: {payload[:200]}")
        if "error" in event:
            message = (event["error"] or {}).get("message", "") if isinstance(event["error"], dict) else event["error"]
            raise UpstreamBroke("error_event", f"the upstream failed mid-stream: {str(message)[:300]}")
        self.started = True
        self._trace(event.pop(TRACE_FIELD, None))
        self.end = time.monotonic()
        if self.id is None:
            self.id, self.created = event.get("id"), event.get("created")
        else:
            event["id"], event["created"] = self.id, self.created
        choices = event.get("choices") or []
        if not choices:
            if event.get("usage"):
                self.usage = event["usage"]
                if self.client_usage:
                    self.usage_sent = True
                    return json.dumps(event)
            return None
        return json.dumps(event) if self._choice(choices[0]) else None

    def _trace(self, trace: dict | None) -> None:
        if not trace:
            return
        if self.prompt_ids is None and trace.get("prompt_token_ids"):
            self.prompt_ids = list(trace["prompt_token_ids"])
        if trace.get("seed") is not None:
            self.seed = trace["seed"]
        self.token_ids.extend(trace.get("token_ids") or ())

    def _choice(self, choice: dict) -> bool:
        """Record one choice; False when it carries nothing for the client (a trace-only or repeated role chunk)."""
        delta = choice.get("delta")
        if delta is not None:
            text = delta.get("content") or ""
            if delta.get("role"):
                if self.role_sent:
                    delta.pop("role")
                else:
                    self.role_sent = True
                    return True
        else:
            text = choice.get("text") or ""
        reason = choice.get("finish_reason")
        logprobs = self._logprobs(choice.get("logprobs"))
        if not text and reason is None and not logprobs:
            return False
        if text:
            self.first = self.first or self.end
            self.sent_chars += len(text)
            self.parts.append(text)
        if reason is not None:
            self.finish_reason = reason
        return True

    def _logprobs(self, logprobs: dict | None) -> bool:
        """Record a choice's log-probabilities (True when it has some); only a client that asked for no stream
        needs them kept, for its one answer. The completions API's text offsets come counted over the whole
        answer: a worker that takes a request over counts from the end of the tokens it was handed."""
        if not isinstance(logprobs, dict):
            return False
        if self.api == "chat/completions":
            content = logprobs.get("content") or []
            if not self.client_stream:
                self.chat_logprobs.extend(content)
            return bool(content)
        tokens = logprobs.get("tokens") or []
        if not self.client_stream:
            done = self.completion_logprobs
            done.tokens.extend(tokens)
            done.text_offset.extend(logprobs.get("text_offset") or [])
            done.token_logprobs.extend(logprobs.get("token_logprobs") or [])
            done.top_logprobs.extend(logprobs.get("top_logprobs") or [])
        return bool(tokens)

    # ---- what goes on ------------------------------------------------------------------------------
    def resumes(self) -> tuple[SpanContext, ...]:
        """The span a resumed stream links to: the stream that broke (none before a break)."""
        return () if self.broken is None else (self.broken,)

    def resume(self) -> Resume:
        return Resume(output_token_ids=self.token_ids, sent_chars=self.sent_chars, seed=self.seed)

    @property
    def resumable(self) -> bool:
        return self.prompt_ids is not None

    def final_usage(self) -> Usage:
        """The upstream's count; when the stream broke after the last token but before its usage
        event, the same figures from the traced token ids (the engine counts them the same way)."""
        if self.usage is not None:
            return Usage.model_validate(self.usage)
        return usage(len(self.prompt_ids or ()), len(self.token_ids))

    def tail(self) -> list[str]:
        """Events the client still needs after the last upstream: the usage it asked for."""
        if not self.client_usage or self.usage_sent:
            return []
        self.usage_sent = True
        if self.api == "chat/completions":
            chunk = ChatCompletionChunk(id=self.id or "", model=self.model, choices=[], usage=self.final_usage())
        else:
            chunk = CompletionResponse(id=self.id or "", model=self.model, choices=[], usage=self.final_usage())
        if self.created is not None:
            chunk.created = self.created
        return [chunk.model_dump_json()]

    def answer(self) -> str:
        """The whole answer, for a client that asked for no stream."""
        text, use = "".join(self.parts), self.final_usage()
        if self.api == "chat/completions":
            logprobs = ChatLogprobs.model_validate({"content": self.chat_logprobs}) if self.wants_logprobs else None
            response = ChatCompletionResponse(
                id=self.id or "", model=self.model, usage=use,
                choices=[ChatChoice(message=ChatMessageOut(content=text), logprobs=logprobs,
                                    finish_reason=self.finish_reason)])
        else:
            response = CompletionResponse(id=self.id or "", model=self.model, usage=use, choices=[
                CompletionChoice(text=text, logprobs=self.completion_logprobs if self.wants_logprobs else None,
                                 finish_reason=self.finish_reason)])
        if self.created is not None:
            response.created = self.created
        return response.model_dump_json()

    # ---- what the metrics read ----------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0)) if self.usage else len(self.token_ids)

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.t0

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)
