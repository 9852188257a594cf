"""What a request's stream carries out of the engine, and the ways to receive it (a sink, an async stream,
a whole result)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from engine.core.pd_messages import HandoffResult
from engine.core.sampling_params import Logprob
from engine.telemetry.tracing import Timeline, engine_spans


@dataclass
class RequestOutput:
    """One event of a request's stream: new tokens and text, and the finish reason on the last."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    handoff: HandoffResult | None = None
    seed: int | None = None  # what the request draws from: another worker resuming it draws the same
    logprobs: list[Logprob] | None = None  # one per token id, when the request asked for them
    timeline: Timeline | None = None  # on the last output: when the request passed each point in the engine

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Result:
    """A whole request's outcome (the synchronous `generate` API)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[Logprob] = field(default_factory=list)  # one per token id, when the request asked for them


Sink = Callable[[RequestOutput], None]


class RequestStream:
    """Async iterator over one request's outputs, fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.request_id = ""

    def _trace(self, timeline: Timeline) -> None:
        """The request's engine phases as spans, made once the loop is free: off the path of the answer (a prefill's
        handoff is on its request's TTFT), yet in this request's context (call_soon copies it), so under its span."""
        self.loop.call_soon(engine_spans, timeline)

    def put(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    async def next(self, timeout_s: float) -> RequestOutput | None:
        """The next output, or None when none came within `timeout_s`; the stream stays usable either way (the
        queue's get gives nothing up when it is cancelled)."""
        if self.queue.empty():
            try:
                out = await asyncio.wait_for(self.queue.get(), timeout_s)
            except TimeoutError:
                return None
        else:
            out = self.queue.get_nowait()  # no task for an output that is already here
        if isinstance(out, Exception):
            raise out
        if out.timeline is not None:
            self._trace(out.timeline)
        return out

    async def __aiter__(self):
        while True:
            out = await self.queue.get()
            if isinstance(out, Exception):  # refused after submission (an engine core in its own process)
                raise out
            if out.timeline is not None:
                self._trace(out.timeline)
            yield out
            if out.finished:
                return
