"""The engine core in a process of its own: scheduling, model steps and sampling, apart from HTTP.

Why: in one process, HTTP parsing, tokenization, detokenization, stop strings, SSE and the model step share
one GIL, so every microsecond the event loop spends is a microsecond the step waits (vLLM V1 split its API
server from an EngineCore process for this). Here the engine thread steps the model and nothing else; two
I/O threads move messages (engine/core/core_messages.py) over ZMQ, whose sends and receives release the GIL:
- the input thread (this process's main thread) reads Add / Abort / Call / Beat from every API server on one
  ROUTER socket and hands them to the engine, which takes submissions from any thread;
- the output thread sends each API server its outputs in one message per wake-up (a step's outputs, mostly),
  its control-call replies, and a heartbeat every BEAT_S carrying readiness and load.

Failure: an API server silent for CLIENT_TIMEOUT_S has its requests aborted (their KV blocks freed). When the
engine thread fails, its requests get their error, the outputs are flushed and the process exits with
EXIT_ENGINE_FAILED; the API servers see it gone, end their streams and exit, and the group is rebuilt. When the
process that started the core dies, the core leaves too (engine.runtime.process.die_with_parent).

Run by engine/server/core_client.py: `python -m engine.core.core_process SPEC_JSON`.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NoReturn

import zmq
from pydantic import BaseModel, Field

from engine.core import core_messages as m
from engine.core.engine_config import EngineConfig
from engine.core.admission import EngineError
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.resume import Resume
from engine.core.sampling_params import SamplingParams
from engine.runtime.errors import EXIT_ENGINE_FAILED, exit_member
from engine.runtime.process import die_with_parent

log = logging.getLogger(__name__)


class CoreSpec(BaseModel):
    """What the API server process hands its engine core on the command line."""

    model_dir: str = Field(description="the checkpoint directory (already pulled and verified)")
    engine: EngineConfig
    input_address: str = Field(description="ZMQ address the core binds its ROUTER on (ipc://...)")
    threads: int | None = Field(None, ge=1, description="the engine thread's compute threads (engine/runtime/intraop.py)")
    kernels: str | None = Field(None, description="tideflow_kernels.startup mode")
    metrics_group: str = ""
    metrics_version: str = ""
    role: str = "colocated"
    starter_pid: int = Field(default_factory=os.getpid, description="the core ends when this process does")
    socket_dir: str | None = Field(None, description="the member's folder of ipc sockets: the core removes it when it "
                                                     "is stopped or its starter dies (nothing is left behind)")


class EngineCore:
    """One engine and the sockets around it; `serve()` runs until the process is ended or the engine fails."""

    def __init__(self, engine: LLMEngine, input_address: str) -> None:
        self.engine = engine
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(input_address)
        self.outbox: queue.Queue[tuple[bytes, Any]] = queue.Queue()  # (API server, Output | Reply | address)
        self.owner: dict[str, bytes] = {}  # request id -> the API server that sent it
        self.last_seen: dict[bytes, float] = {}
        self.lock = threading.Lock()
        self.calls = ThreadPoolExecutor(1, thread_name_prefix="tideflow-core-call")  # warm-up blocks: not here
        self.stopping = threading.Event()
        self.flushed = threading.Event()
        self.decode = m.to_core_decoder().decode
        self.handlers: dict[str, Callable[..., Any]] = {
            "info": self.info,
            "warm_up": engine.warm_up,
            "release_kv": self.release_kv,
            "allocate_kv": self.allocate_kv,
            "set_ready": self.set_ready,
            "metrics": lambda: engine.render_metrics()[0].decode(),
            "count_http_error": engine.count_http_error,
        }

    # ---- control calls ----------------------------------------------------------------------
    def info(self) -> dict:
        e = self.engine
        return {"vocab_size": e.vocab_size, "max_model_len": e.max_model_len, "kv_blocks": e.kv_blocks,
                "max_queue": e.config.max_queue, "ready": e.ready}

    def release_kv(self) -> dict:
        self.engine.release_kv()
        return self.info()

    def allocate_kv(self, num_blocks: int) -> dict:
        self.engine.allocate_kv(int(num_blocks))
        return self.info()

    def set_ready(self, ready: bool) -> None:
        self.engine.ready = bool(ready)

    # ---- the input thread -------------------------------------------------------------------
    def serve(self) -> None:
        output = threading.Thread(target=self._send_loop, name="tideflow-core-output", daemon=True)
        output.start()
        self.engine.on_failure = self._on_engine_failure
        self.engine.start()
        log.info("engine core %d serving on %s", os.getpid(), self.inbox.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            while not self.stopping.is_set():
                if self.inbox.poll(int(m.BEAT_S * 1000)):
                    while True:
                        try:
                            client, frame = self.inbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._take(client, frame)
                self._reap_silent(time.monotonic())
        finally:
            self.engine.stop()
            self.stopping.set()
            output.join(timeout=5)
            self.calls.shutdown(wait=False, cancel_futures=True)
            self.context.destroy(linger=0)

    def _take(self, client: bytes, frame: bytes) -> None:
        try:
            msg = self.decode(frame)
        except Exception as exc:  # a malformed message is that sender's bug; the core serves on
            log.warning("dropped a malformed message: %s", exc)
            return
        known = client in self.last_seen
        self.last_seen[client] = time.monotonic()
        if isinstance(msg, m.Beat) and not known:  # taken for gone, yet alive: its outputs go out again
            self.outbox.put((client, m.Hello(msg.output_address)))
        elif isinstance(msg, m.Add):
            self._add(client, msg)
        elif isinstance(msg, m.Abort):
            for request_id in msg.request_ids:
                self.engine.abort(request_id)
        elif isinstance(msg, m.Call):
            self.calls.submit(self._call, client, msg)
        elif isinstance(msg, m.Hello):
            self.outbox.put((client, msg))

    def _add(self, client: bytes, msg: m.Add) -> None:
        try:
            params = SamplingParams.model_validate(msg.params)
            resume = None if msg.resume is None else Resume.model_validate(msg.resume)
            with self.lock:
                self.owner[msg.request_id] = client
            self.engine.submit(msg.prompt_token_ids, params, lambda out: self.outbox.put((client, out)),
                               msg.request_id, resume=resume, client=msg.client)
        except Exception as exc:  # refused: answered to its sender alone
            with self.lock:
                self.owner.pop(msg.request_id, None)
            status = exc.status if isinstance(exc, EngineError) else 400
            self.outbox.put((client, m.Output(msg.request_id, [], "error", len(msg.prompt_token_ids), 0, 0,
                                              str(exc), status=status)))

    def _call(self, client: bytes, call: m.Call) -> None:
        handler = self.handlers.get(call.name)
        try:
            if handler is None:
                raise EngineError(f"no such engine-core call: {call.name}")
            reply = m.Reply(call.call_id, value=handler(*call.args))
        except Exception as exc:
            reply = m.Reply(call.call_id, error=str(exc), status=getattr(exc, "status", 500))
        if call.call_id:
            self.outbox.put((client, reply))

    def _reap_silent(self, now: float) -> None:
        """Abort the requests of API servers that stopped beating (killed, hung): their KV is freed."""
        gone = [c for c, seen in self.last_seen.items() if now - seen > m.CLIENT_TIMEOUT_S]
        for client in gone:
            del self.last_seen[client]
            with self.lock:
                orphans = [rid for rid, owner in self.owner.items() if owner == client]
            if orphans:
                log.warning("an API server went silent: aborting its %d open requests", len(orphans))
            for request_id in orphans:
                self.engine.abort(request_id)
            self.outbox.put((client, None))  # the output thread closes its socket

    # ---- the output thread ------------------------------------------------------------------
    def _send_loop(self) -> None:
        sockets: dict[bytes, zmq.Socket] = {}
        encode = m.encoder().encode
        next_beat = time.monotonic()
        while True:
            try:
                items = [self.outbox.get(timeout=m.BEAT_S)]
            except queue.Empty:
                items = []
            while True:  # everything at hand goes out together: one message per API server
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            batches: dict[bytes, list[m.Output]] = {}
            for client, item in items:
                if isinstance(item, m.Hello):
                    if client in sockets:
                        sockets.pop(client).close()
                    sock = self.context.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, 0)  # outputs are never dropped; the API server reads them all
                    sock.connect(item.output_address)
                    sockets[client] = sock
                elif item is None:
                    sock = sockets.pop(client, None)
                    if sock is not None:
                        sock.close()
                elif isinstance(item, m.Reply):
                    self._send(sockets, client, encode(item))
                else:
                    batches.setdefault(client, []).append(item if isinstance(item, m.Output) else _wire(item))
            stats = {**self.engine.stats, "live": int(self.engine.live())}  # the API server's heartbeats read it
            for client, outputs in batches.items():
                finished = [o.request_id for o in outputs if o.finish_reason is not None]
                if finished:
                    with self.lock:
                        for request_id in finished:
                            self.owner.pop(request_id, None)
                self._send(sockets, client, encode(m.Outputs(outputs, stats)))
            now = time.monotonic()
            if now >= next_beat:
                beat = encode(m.State(self.engine.ready, stats, self.engine.failure))
                for client in list(sockets):
                    self._send(sockets, client, beat)
                next_beat = now + m.BEAT_S
            if self.stopping.is_set() and self.outbox.empty():
                self.flushed.set()
                for sock in sockets.values():
                    sock.close(linger=1000)
                return

    @staticmethod
    def _send(sockets: dict[bytes, zmq.Socket], client: bytes, frame: bytes) -> None:
        """Never blocks: a live API server's queue has no bound (SNDHWM 0), so only a gone one refuses, and
        what was meant for it is dropped (its requests are being aborted)."""
        sock = sockets.get(client)
        if sock is not None:
            try:
                sock.send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass

    def _on_engine_failure(self, why: str) -> None:
        """The engine thread failed (its requests have their error by now): flush, then leave."""
        self.stopping.set()
        self.flushed.wait(timeout=2)
        exit_member(EXIT_ENGINE_FAILED, why)


def _wire(out: RequestOutput) -> m.Output:
    return m.Output(out.request_id, out.token_ids, out.finish_reason, out.prompt_tokens, out.completion_tokens,
                    out.cached_tokens, out.error, out.seed, logprobs=out.logprobs,
                    timeline=None if out.timeline is None else list(out.timeline))


def main(argv: list[str]) -> int:
    from engine.runtime import intraop
    from engine.runtime.device import resolve_device
    from engine.telemetry.metrics import MetricFactory, ServingMetrics
    from tideflow_kernels.startup import arch_for, startup_ops

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    spec = CoreSpec.model_validate_json(argv[0])
    signal.signal(signal.SIGTERM, lambda signum, frame: _leave(spec))
    try:
        die_with_parent(spec.starter_pid)  # also while loading
        intraop.serial_process(spec.threads)  # before any torch op: the engine thread alone runs parallel ops
        startup_ops(arch_for(resolve_device(spec.engine.device)), spec.kernels)
        metrics = ServingMetrics(MetricFactory(group=spec.metrics_group, version=spec.metrics_version, role=spec.role))
        engine = LLMEngine.from_dir(spec.model_dir, spec.engine, metrics, make_text=False)
        EngineCore(engine, spec.input_address).serve()
    finally:
        _remove_sockets(spec)
    return 0


def _leave(spec: CoreSpec) -> NoReturn:
    """SIGTERM: the member is stopping, or its starter died (the kernel's signal). No API server connects to this
    core again, so the member's socket folder goes first (connections made already keep working): a member stopped
    with less grace than its shutdown takes, or SIGKILLed, leaves nothing behind. Then SystemExit unwinds the core
    in order."""
    _remove_sockets(spec)
    raise SystemExit(0)


def _remove_sockets(spec: CoreSpec) -> None:
    if spec.socket_dir:
        shutil.rmtree(spec.socket_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
