"""An API server's handle on an engine core in another process (engine/core/core_process.py).

It answers the same surface the HTTP front uses of an in-process LLMEngine (stream, abort, ready, stats,
vocab_size, max_model_len, warm_up, release_kv/allocate_kv, render_metrics), so the routes do not care
where the engine runs. What moved here from the engine thread: the text. Each request's token ids are
detokenized and checked for stop strings on this process's receiver thread (engine.core.output_text.RequestText,
as the engine thread does in-process); a stop string ends the request here and aborts it in the core.

One receiver thread reads the core's messages (a step's outputs arrive as one message), makes the text and
hands each event loop its outputs in one call; it also sends the heartbeat. When the core process dies or
stops beating for CORE_TIMEOUT_S, every open stream ends with an error (the router migrates it), /ready
turns false and `on_failure` runs (a member exits so its group is rebuilt).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import zmq

from engine.core import core_messages as m
from engine.core.core_process import CoreSpec
from engine.core.admission import EngineError, PromptTooLong, QueueFull, check_request
from engine.core.output_text import RequestText
from engine.core.outputs import RequestOutput, RequestStream
from engine.core.resume import Resume
from engine.core.sampling_params import SamplingParams
from engine.runtime.process import Child
from engine.telemetry.tracing import Timeline
from engine.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LIVE_S = 1.0  # a core heard from this recently is alive (it beats every BEAT_S)
CORE_TIMEOUT_S = 3.0  # a core that sends nothing this long (it beats every BEAT_S) is hung
POLL_MS = 100  # how often the receiver looks at the core process when nothing arrives: /ready false within 1 s
CONNECT_TIMEOUT_S = 1800.0  # the core loads the model and builds its ops before it answers


class CoreGone(EngineError):
    status = 503
    code = "engine_core_gone"


@dataclass(eq=False)
class _Open:
    """One request this API server has open in the core, and its text."""

    stream: RequestStream
    text: RequestText
    tokens: list[int] = field(default_factory=list)  # every generated token (a resumed request's first)

    def take(self, out: m.Output) -> tuple[RequestOutput, bool]:
        """The core's output made into the client's; True as second when a stop string ended it here."""
        for i, tok in enumerate(out.token_ids):
            self.tokens.append(tok)
            if self.text.push(tok):
                final = self.text.rest(self.tokens)
                return self._made(out, i + 1, final, "stop"), out.finish_reason is None
        reason = out.finish_reason
        text = self.text.delta() if reason is None else self.text.rest(self.tokens)
        return self._made(out, len(out.token_ids), text, reason), False

    def _made(self, out: m.Output, count: int, text: str, reason: str | None) -> RequestOutput:
        """The client's output of the core's first `count` tokens."""
        logprobs = None if out.logprobs is None else out.logprobs[:count]
        timeline = None if out.timeline is None else Timeline(*out.timeline)
        return RequestOutput(out.request_id, out.token_ids[:count], text, reason, out.prompt_tokens, len(self.tokens),
                             out.cached_tokens, out.error, seed=out.seed, logprobs=logprobs, timeline=timeline)


class CoreClient:
    """The engine core as one API server process sees it."""

    def __init__(self, input_address: str, tokenizer: Tokenizer, socket_dir: Path, core: Child | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """`core`: the core process when this process started it (its death is then seen at once, not after
        CORE_TIMEOUT_S of silence)."""
        self.tokenizer, self.core = tokenizer, core
        self.context = zmq.Context()
        self._inbox = self.context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(f"ipc://{socket_dir}/out-{uuid.uuid4().hex[:12]}")
        self._outbox = self.context.socket(zmq.DEALER)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"  # names this API server and its request ids
        self._outbox.setsockopt(zmq.IDENTITY, self._prefix.encode())
        self._outbox.connect(input_address)
        self._send_lock = threading.Lock()  # the socket is used by the event loop, to_thread workers and the receiver
        self._encode = m.encoder().encode
        self._open: dict[str, _Open] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._request_ids = itertools.count()
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.stats: dict[str, int] = {"queued": 0, "running": 0, "kv_blocks_free": 0, "queued_prefill_tokens": 0}
        self._core_ready = False
        self._heard: float | None = None  # nothing heard yet: the core is loading (silence is no sign then)
        self._stopping = threading.Event()
        self._address = self._inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self._send(m.Hello(self._address))
        self._receiver = threading.Thread(target=self._receive_loop, name="tideflow-core-client", daemon=True)
        self._receiver.start()
        info = self.call("info", timeout=connect_timeout_s)
        self._info(info)
        self.max_queue, self._core_ready = int(info["max_queue"]), bool(info["ready"])

    # ---- what the routes read ---------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.failure is None and self._core_ready

    @ready.setter
    def ready(self, value: bool) -> None:
        """Readiness lives in the core (every API server reads it there); set it there and wait."""
        self.call("set_ready", bool(value))
        self._core_ready = bool(value)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def start(self) -> None:
        """The receiver runs from construction on; here for the app's lifespan, as LLMEngine.start."""

    def stop(self) -> None:
        self._stopping.set()
        self._receiver.join(timeout=5)
        self.context.destroy(linger=0)
        if self.core is not None:
            self.core.stop()

    def warm_up(self) -> None:
        self.call("warm_up", timeout=CONNECT_TIMEOUT_S)
        self._core_ready = True

    def release_kv(self) -> None:
        self._info(self.call("release_kv", timeout=120))

    def allocate_kv(self, num_blocks: int) -> None:
        self._info(self.call("allocate_kv", num_blocks, timeout=120))

    def render_metrics(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST

        return self.call("metrics").encode(), CONTENT_TYPE_LATEST

    def count_http_error(self, status: int) -> None:
        self._send(m.Call(0, "count_http_error", [status]))

    # ---- requests ---------------------------------------------------------------------------
    def check(self, prompt_tokens: list[int], params: SamplingParams, resume: Resume | None = None) -> None:
        check_request(prompt_tokens, params, self.max_model_len, resume)

    def stream(self, prompt_tokens: list[int], params: SamplingParams, request_id: str | None = None,
               handoff=None, images=None, resume: Resume | None = None, client: str = "") -> RequestStream:
        """Submit from a coroutine; iterate the returned stream with `async for`."""
        if handoff is not None or images is not None:
            raise EngineError("prefill handoff and image prompts run only with the engine in the API server's "
                              "process (serve --engine-core thread)")
        if self.failure is not None:
            raise CoreGone(self.failure)
        self.check(prompt_tokens, params, resume)
        if self.stats["queued"] >= self.max_queue:
            raise QueueFull(f"the queue holds {self.max_queue} waiting requests; retry later")
        stream = RequestStream(asyncio.get_running_loop())
        stream.request_id = request_id or f"req-{self._prefix}-{next(self._request_ids)}"
        streamed = None if resume is None else list(resume.output_token_ids)
        opened = _Open(stream, RequestText(self.tokenizer, params.stop, streamed,
                                           0 if resume is None else resume.sent_chars), streamed or [])
        self._open[stream.request_id] = opened
        self._send(m.Add(stream.request_id, list(prompt_tokens), params.model_dump(),
                         None if resume is None else resume.model_dump(), client))
        return stream

    def abort(self, request_id: str) -> None:
        if self._open.pop(request_id, None) is not None:
            self._send(m.Abort([request_id]))

    # ---- control calls ----------------------------------------------------------------------
    def call(self, name: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run engine.core.core_process's call `name` in the core and return its value (raises its error)."""
        if self.failure is not None:
            raise CoreGone(self.failure)
        call_id = next(self._call_ids)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls[call_id] = done
        self._send(m.Call(call_id, name, list(args)))
        try:
            return done.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise CoreGone(f"the engine core did not answer '{name}' in {timeout:g}s") from None
        finally:
            self._calls.pop(call_id, None)

    def _info(self, info: dict) -> None:
        self.vocab_size, self.max_model_len, self.kv_blocks = info["vocab_size"], info["max_model_len"], info["kv_blocks"]

    def _send(self, msg: m.ToCore, required: bool = True) -> None:
        """Never blocks: with no core at the other end (gone), a required message raises CoreGone."""
        frame = self._encode(msg)
        try:
            with self._send_lock:
                self._outbox.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if required:
                raise CoreGone("the engine core does not take messages") from None

    # ---- the receiver thread ----------------------------------------------------------------
    def _receive_loop(self) -> None:
        decode = m.from_core_decoder().decode
        next_beat = 0.0
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    self._send(m.Beat(self._address), required=False)
                    next_beat = now + m.BEAT_S
                if self._inbox.poll(POLL_MS):
                    while True:
                        try:
                            frame = self._inbox.recv(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._heard = time.monotonic()
                        self._take(decode(frame.buffer))
                gone = self._core_gone(time.monotonic())
                if gone is not None:
                    self._fail_all(gone)
                    return
        except zmq.ContextTerminated:
            return
        except Exception as exc:  # this thread is the only way outputs arrive: losing it is losing the core
            log.exception("the engine core's receiver failed")
            self._fail_all(f"the engine core's receiver failed: {exc}")

    def live(self) -> bool:
        """The core beat within LIVE_S and said its engine is between steps or in one within its budget
        (engine.core.step_clock): what the streams' heartbeats need, as LLMEngine.live()."""
        heard = self._heard
        return heard is not None and time.monotonic() - heard < LIVE_S and bool(self.stats.get("live", 1))

    def _core_gone(self, now: float) -> str | None:
        if self.core is not None and not self.core.alive():
            return f"the engine core exited with status {self.core.returncode}"
        if self._heard is not None and now - self._heard > CORE_TIMEOUT_S:
            return f"the engine core sent nothing for {CORE_TIMEOUT_S:g}s"
        return None

    def _take(self, msg: m.FromCore) -> None:
        if isinstance(msg, m.Outputs):
            self.stats = msg.stats
            self._deliver(msg.outputs)
        elif isinstance(msg, m.State):
            self.stats, self._core_ready = msg.stats, msg.ready
        elif isinstance(msg, m.Reply):
            done = self._calls.get(msg.call_id)
            if done is not None and not done.done():
                if msg.error is None:
                    done.set_result(msg.value)
                else:
                    done.set_exception(_refusal(msg.error, msg.status))

    def _deliver(self, outputs: list[m.Output]) -> None:
        items: list[tuple[RequestStream, RequestOutput | Exception]] = []
        stopped: list[str] = []
        for out in outputs:
            opened = self._open.get(out.request_id)
            if opened is None:  # ended here already (a stop string, the client went away)
                continue
            if out.status:
                self._open.pop(out.request_id, None)
                items.append((opened.stream, _refusal(out.error, out.status)))
                continue
            made, stop_here = opened.take(out)
            if made.finished:
                self._open.pop(out.request_id, None)
            if stop_here:
                stopped.append(out.request_id)
            items.append((opened.stream, made))
        if stopped:
            self._send(m.Abort(stopped))
        _hand_over(items)

    def _fail_all(self, why: str) -> None:
        self.failure = why
        self._core_ready = False
        log.error("%s: ending %d open requests", why, len(self._open))
        opened, self._open = list(self._open.items()), {}
        _hand_over([(o.stream, RequestOutput(request_id, [], "", "error", 0, len(o.tokens), 0, why))
                    for request_id, o in opened])
        for done in list(self._calls.values()):
            if not done.done():
                done.set_exception(CoreGone(why))
        if self.on_failure is not None and not self._stopping.is_set():
            self.on_failure(why)


def _hand_over(items: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
    """Give each stream its outputs on its own event loop: one call per loop, whatever the number of streams."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | Exception]]] = {}
    for stream, out in items:
        by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # that loop is closed: nobody reads those streams any more
            pass


def _put_all(items: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _refusal(message: str | None, status: int) -> EngineError:
    """The core's refusal as the error the routes answer: 429 queue full, 400 too long, else its status (500)."""
    kind = {429: QueueFull, 400: PromptTooLong}.get(status, EngineError)
    error = kind(message or "the engine core refused the request")
    error.status = status or 500
    return error


def start_core(spec: CoreSpec, log_path: Path | None = None) -> Child:
    """The engine-core process of `spec`, supervised (engine/runtime/process.py); its log goes to `log_path`, or to this
    process's own output when None."""
    return Child("engine-core", [sys.executable, "-m", "engine.core.core_process", spec.model_dump_json()], log_path)


def socket_dir() -> Path:
    """A private folder (0700) for the ipc sockets of one member's API servers and core."""
    return Path(tempfile.mkdtemp(prefix="tideflow-core-"))
