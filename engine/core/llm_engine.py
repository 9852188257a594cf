"""The serving engine: a background thread stepping the scheduler and the ModelRunner.

Requests are submitted from any thread (or event loop); each gets its outputs through a sink
callable, called on the engine thread. `stream` wraps that in an asyncio queue fed through
`loop.call_soon_threadsafe`, which is what the HTTP server uses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.runtime.device import to_device
from engine.encoder.prompt import block_extras
from engine.encoder.splice import step_embeds
from engine.core.client_tokens import ClientTokens, client_cap
from engine.core.engine_config import DEFAULT_KV_FRACTION, EngineConfig
from engine.encoder.splice import SplicedPrompt
from engine.core.admission import EngineError, QueueFull, check_request
from engine.runtime import intraop
from engine.core.kv_events import KVEventLog, KVEventPage
from engine.core.kv_cache import BlockAllocator, OutOfBlocks, num_blocks_for_budget
from engine.core.kv_fetches import PendingFetches
from engine.kvtier.metrics import TierMetrics
from engine.kvtier.tiered import TieredKV, open_tiers
from engine.model.decoder import MoEForCausalLM
from engine.model.loader import load_model
from engine.core.decode_graphs import decode_graphs_for
from engine.core.model_runner import ModelRunner, SeqStep
from engine.core.outputs import RequestOutput, RequestStream, Result, Sink
from engine.core.output_text import RequestText
from engine.core.pd import Handoff, PrefixGone, hand_off, import_prefilled
from engine.core.pd_messages import HandoffResult
from engine.core.resume import Resume
from engine.core.sampling import sample
from engine.core.sampling_params import Logprob, SamplingParams, resolve_seed
from engine.core.scheduler import Scheduler, StepPlan
from engine.core.sequence import SeqStatus, Sequence
from engine.telemetry.metrics import ServingMetrics
from engine.telemetry.tracing import Timeline, wall_ns
from engine.core.step_clock import StepClock
from engine.core.step_cost import StepCost
from engine.core.stop import finish_reason
from engine.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Import:
    """A prefilled sequence waiting for KV blocks on a decode worker."""

    first_token: int
    first_logprob: Logprob | None
    kv: memoryview
    on_imported: Callable[[], None]
    skipped_blocks: int = 0  # leading blocks prefill left out: this worker holds them (engine.core.pd)


@dataclass(eq=False)
class _Request:
    seq: Sequence
    sink: Sink
    text: RequestText | None  # None when the API process makes the text (engine/core/core_process.py)
    imported: _Import | None = None
    spliced: SplicedPrompt | None = None  # a prompt with images: embeddings for the image positions
    open_tokens: int = 0  # what it counts against its client's cap (ClientTokens) until it leaves the engine
    first_token_at: float | None = None
    last_token_at: float | None = None


class LLMEngine:
    def __init__(self, model: MoEForCausalLM, tokenizer: Tokenizer, config: EngineConfig,
                 metrics: ServingMetrics | None = None, runner=None, make_text: bool = True,
                 kv_tiers: TieredKV | None = None) -> None:
        """`runner` replaces the ModelRunner (e.g. engine.parallel.serving.DEPRunner, sized by its owner);
        a runner with `lockstep = True` is stepped every iteration: idle, the loop calls its `idle(wake)`.
        `make_text=False`: outputs carry token ids only, and stop strings are left to whoever makes the text
        (an engine core in its own process: its API server detokenizes, engine/server/core_client.py).
        `kv_tiers` keeps evicted blocks below the pool and loads a prompt's blocks from there (engine.kvtier)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.make_text = make_text
        self.metrics = metrics if metrics is not None else ServingMetrics()
        mc = model.config
        graphs = None if runner is not None else decode_graphs_for(model, config)
        if runner is not None:
            num_blocks = runner.num_blocks
        elif config.kv_cache_bytes is not None:
            num_blocks = num_blocks_for_budget(mc, config.block_size, config.device, kv_cache_bytes=config.kv_cache_bytes)
        else:
            fraction = config.kv_cache_fraction or DEFAULT_KV_FRACTION
            num_blocks = num_blocks_for_budget(mc, config.block_size, config.device, kv_cache_fraction=fraction,
                                               reserve_bytes=graphs.pool_bytes() if graphs is not None else 0)
        self.runner = runner if runner is not None else ModelRunner(model, num_blocks, config.block_size, graphs)
        self.lockstep = bool(getattr(self.runner, "lockstep", False))
        self.kv_tiers = kv_tiers
        self.kv_events = KVEventLog() if config.enable_prefix_cache else None
        if kv_tiers is not None:
            kv_tiers.events = self.kv_events
        self.allocator = self._new_allocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs, config.max_batch_tokens, config.max_wait_ms / 1000,
                                   config.lone_arrival_ms / 1000 if config.lone_arrival_ms else None,
                                   fair=config.scheduling == "fair",
                                   cost=StepCost(config.step_target_ms / 1000 if config.step_target_ms else None))
        self.eos_ids = tuple(set(mc.eos_ids) | set(tokenizer.eos_ids))
        self.max_model_len = min(mc.context_length, num_blocks * config.block_size)
        self.ready = False
        self.warmed = False  # warm_up ran: a KV cache allocated later (a standby's activation) gets its graphs then
        self._requests: dict[str, _Request] = {}
        self._adds: deque[_Request] = deque()  # filled by any thread, drained by the engine thread
        self._imports: list[_Request] = []  # prefilled elsewhere, in arrival order (Scheduler.next_import picks)
        self.stats: dict[str, int] = {"queued": 0, "running": 0, "kv_blocks_free": num_blocks, "queued_prefill_tokens": 0}
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[], None], concurrent.futures.Future]] = deque()  # run by the engine thread
        self._calls_open = False  # True while the engine thread takes calls
        self._calls_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self.client_tokens = ClientTokens(client_cap(config.max_client_tokens, self.max_model_len))
        self.failure: str | None = None  # why the engine thread ended on an error; new requests get it
        self.on_failure: Callable[[str], None] | None = None  # called once its requests have failed (serve exits)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._seen_prefix = (0, 0)
        self._fetching = PendingFetches(kv_tiers if config.enable_prefix_cache else None, config.block_size,
                                        self._wake.set)
        self.clock = StepClock()  # whether the engine is busy or stuck (the members' stream heartbeats read it)

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: EngineConfig, metrics: ServingMetrics | None = None,
                 make_text: bool = True) -> "LLMEngine":
        model = load_model(model_dir, config.dtype, config.device)
        metrics = metrics if metrics is not None else ServingMetrics()
        tiers = None
        if config.kv_tiers is not None:
            tiers = open_tiers(config.kv_tiers, model_dir, config.model_name or Path(model_dir).name, config.version,
                               model.config, config.block_size, TierMetrics(metrics.factory))
        return cls(model, Tokenizer(model_dir), config, metrics, make_text=make_text, kv_tiers=tiers)

    def _new_allocator(self, num_blocks: int) -> BlockAllocator:
        return BlockAllocator(num_blocks, self.config.block_size, self.config.enable_prefix_cache,
                              lower=self.kv_tiers, kv_cache=lambda: self.runner.kv_cache, events=self.kv_events)

    def kv_event_page(self, epoch: str, after: int) -> KVEventPage | None:
        """What this engine's KV holds, as events after the reader's cursor (engine.core.kv_events); None without
        a prefix cache (nothing is ever reused, nothing to route by)."""
        if self.kv_events is None:
            return None
        return self.kv_events.page(epoch, after, self._held)

    def _held(self) -> dict[str, list[int]]:
        held = {"device": []}
        if self.runner.num_blocks:
            held["device"] = self._on_engine_thread(lambda: list(self.allocator.cached))
        if self.kv_tiers is not None:
            held.update(self.kv_tiers.held())
        return held

    # ---- what the HTTP front reads (engine/server/core_client.py answers the same) ---------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def kv_blocks(self) -> int:
        """KV blocks allocated now (0 while a standby engine has released its cache)."""
        return self.runner.num_blocks

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition of this engine's metrics, and its content type."""
        return self.metrics.render()

    def count_http_error(self, status: int) -> None:
        self.metrics.requests.labels(f"http_{status}").inc()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="tideflow-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    def live(self) -> bool:
        """Between steps, or in one still within its budget (engine.core.step_clock)."""
        return self.clock.live()

    def warm_up(self) -> None:
        """One short generation through the whole path; the engine is ready after it."""
        self.generate([self.tokenizer.encode("warm up") or [0]], SamplingParams(max_tokens=4))
        self._on_engine_thread(self.scheduler.forget_clients)  # the warm-up is nobody: no share is kept for it
        self._on_engine_thread(self._capture_graphs)
        self.warmed = True
        self.ready = True

    def _capture_graphs(self) -> None:
        """Decode as CUDA graphs over the KV cache now allocated (engine.core.decode_graphs); a runner without
        graphs (the CPU, --enforce-eager, a DEP rank) has nothing to capture."""
        capture = getattr(self.runner, "capture_graphs", None)
        if capture is not None:
            capture()

    # ---- submission (any thread) -------------------------------------------------------------
    def check(self, prompt_tokens: list[int], params: SamplingParams, resume: Resume | None = None) -> None:
        check_request(prompt_tokens, params, self.max_model_len, resume)

    def submit(self, prompt_tokens: list[int], params: SamplingParams, sink: Sink, request_id: str | None = None,
               handoff: Handoff | None = None, images: SplicedPrompt | None = None, resume: Resume | None = None,
               client: str = "") -> str:
        """Queue a request. With `handoff`, the engine stops after the first token and exports the
        prompt's KV for a decode worker (the prefill role). `images` carries the embeddings of a
        prompt with images (engine.encoder.prompt.spliced_prompt of the same token ids). `resume`
        continues a request another worker streamed part of (its tokens are recomputed, not resent). `client` names
        who asked (a digest of the client's API key): the scheduler shares the engine between clients."""
        self.check(prompt_tokens, params, resume)
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(request_id, list(prompt_tokens), params, _seed(params, resume), handoff=handoff, client=client)
        return self._enqueue(self._new_request(seq, sink, images, resume))

    def submit_prefilled(self, prompt_tokens: list[int], params: SamplingParams, prefilled: HandoffResult,
                         kv: memoryview, on_imported: Callable[[], None], sink: Sink, request_id: str | None = None,
                         images: SplicedPrompt | None = None, resume: Resume | None = None, client: str = "") -> str:
        """Continue a sequence another engine prefilled (the decode role): its KV bytes are
        imported into fresh blocks and generation resumes from the first token. `images` keeps a
        recompute after preemption (and the prefix cache's block names) right for prompts with images.
        With `resume`, the prefill covered prompt + the resumed tokens, and so does the KV."""
        self.check(prompt_tokens, params, resume)
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(request_id, list(prompt_tokens), params, prefilled.seed, client=client)
        seq.num_cached_prompt = prefilled.num_cached_tokens
        req = self._new_request(seq, sink, images, resume)
        req.imported = _Import(prefilled.first_token, prefilled.first_logprob, kv, on_imported, prefilled.skipped_blocks)
        return self._enqueue(req)

    def _new_request(self, seq: Sequence, sink: Sink, images: SplicedPrompt | None = None,
                     resume: Resume | None = None) -> _Request:
        if images is not None and images.images:
            seq.block_extras = block_extras(images.images, self.config.block_size)
        else:
            images = None
        if seq.params.cache_salt:  # in the first block's name, so no block of another salt is ever shared
            seq.block_extras[0] = b"salt:" + seq.params.cache_salt.encode() + seq.block_extras.get(0, b"")
        streamed = None if resume is None else list(resume.output_token_ids)
        if streamed:
            seq.output_tokens = list(streamed)
        text = None
        if self.make_text:
            text = RequestText(self.tokenizer, seq.params.stop, streamed, 0 if resume is None else resume.sent_chars)
        return _Request(seq, sink, text, spliced=images)

    def _enqueue(self, req: _Request) -> str:
        with self._submit_lock:
            if self.failure is not None:
                raise EngineError(self.failure)
            if self.num_queued >= self.config.max_queue:
                raise QueueFull(f"the queue holds {self.config.max_queue} waiting requests; retry later")
            seq = req.seq
            tokens = len(seq.prompt_tokens) + seq.params.max_tokens
            held = self.client_tokens.take(seq.client, tokens)
            if held is not None:
                raise QueueFull(f"this API key has {held} tokens (prompt + max_tokens) open on this server and may have "
                                f"{self.client_tokens.cap}; this request adds {tokens}: wait for some to finish")
            req.open_tokens = tokens
            self._adds.append(req)
        self._wake.set()
        return req.seq.request_id

    def stream(self, prompt_tokens: list[int], params: SamplingParams, request_id: str | None = None,
               handoff: Handoff | None = None, images: SplicedPrompt | None = None,
               resume: Resume | None = None, client: str = "") -> RequestStream:
        """Submit from a coroutine; iterate the returned stream with `async for`."""
        stream = RequestStream(asyncio.get_running_loop())
        stream.request_id = self.submit(prompt_tokens, params, stream.put, request_id, handoff, images, resume, client)
        return stream

    def stream_prefilled(self, prompt_tokens: list[int], params: SamplingParams, prefilled: HandoffResult,
                         kv: memoryview, on_imported: Callable[[], None],
                         images: SplicedPrompt | None = None, resume: Resume | None = None,
                         client: str = "") -> RequestStream:
        stream = RequestStream(asyncio.get_running_loop())
        stream.request_id = self.submit_prefilled(prompt_tokens, params, prefilled, kv, on_imported, stream.put,
                                                  images=images, resume=resume, client=client)
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone): its blocks are freed on the next engine iteration."""
        self._aborts.append(request_id)
        self._wake.set()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Result]:
        """Blocking: submit all prompts at once, wait for every result (tests, benchmarks, warm-up)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        outputs: queue.Queue[RequestOutput] = queue.Queue()
        ids = [self.submit(p, sp, outputs.put) for p, sp in zip(prompts, plist)]
        results = {i: Result() for i in ids}
        pending = set(ids)
        while pending:
            out = outputs.get(timeout=600)
            res = results[out.request_id]
            res.token_ids += out.token_ids
            res.text += out.text
            res.logprobs += out.logprobs or ()
            if out.finished:
                res.finish_reason, res.cached_tokens = out.finish_reason, out.cached_tokens
                pending.discard(out.request_id)
        return [results[i] for i in ids]

    @property
    def num_queued(self) -> int:
        return len(self._adds) + len(self._fetching) + self.scheduler.num_queued

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_open(self) -> int:
        """Requests submitted and not finished yet (queued, running or waiting for KV import)."""
        return len(self._adds) + len(self._requests)

    # ---- KV memory of a silent instance (engine/server/standby.py) -----------------------------
    def release_kv(self) -> None:
        """Free the KV cache tensors, weights stay loaded; only while no request is open."""
        self._on_engine_thread(self._release_kv)

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate `num_blocks` of KV cache with a fresh allocator (the old prefix cache died with the old tensors)."""
        self._on_engine_thread(lambda: self._allocate_kv(num_blocks))

    def _release_kv(self) -> None:
        if self.num_open:
            raise EngineError(f"{self.num_open} requests are open; drain them before releasing the KV cache")
        self.runner.release()
        if self.runner.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()  # hand the freed blocks back to the device, not just the caching allocator

    def _allocate_kv(self, num_blocks: int) -> None:
        if self.num_open:
            raise EngineError(f"{self.num_open} requests are open; the KV cache cannot be swapped under them")
        self.runner.allocate(num_blocks)
        if self.warmed:  # an activated standby: graphs over the cache it now serves from (the capture time is logged)
            self._capture_graphs()
        self.allocator = self._new_allocator(num_blocks)
        if self.kv_events is not None:
            self.kv_events.renew()
        self.scheduler.allocator = self.allocator
        self.max_model_len = min(self.model.config.context_length, num_blocks * self.config.block_size)
        self.client_tokens.cap = client_cap(self.config.max_client_tokens, self.max_model_len)
        self.stats = {**self.stats, "kv_blocks_free": num_blocks}

    def _on_engine_thread(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread while it runs (inline otherwise), and wait for it: the KV cache's
        tensors are filled by parallel ops, which belong to the engine thread (engine/runtime/intraop.py)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._calls_lock:
            queued = self._calls_open and threading.current_thread() is not self._thread
            if queued:
                self._calls.append((fn, done))
        if not queued:
            return fn()
        self._wake.set()
        return done.result()

    def _run_calls(self, open_after: bool) -> None:
        with self._calls_lock:
            calls, self._calls = list(self._calls), deque()
            self._calls_open = open_after
        for fn, done in calls:
            try:
                done.set_result(fn())
            except Exception as exc:  # handed to the caller, who raises it
                done.set_exception(exc)

    # ---- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a failed model step fails only its batch (_run); this is anything else
            log.exception("the engine thread failed")
            self.failure = f"the engine thread failed: {type(exc).__name__}: {exc}"
            self.ready = False
        self._run_calls(open_after=False)
        pending: list[_Request] = []
        if self.failure is not None:  # nobody may wait on a dead thread: queued requests fail too
            with self._submit_lock:
                pending, self._adds = list(self._adds), deque()
        for req in [*self._requests.values(), *pending]:
            try:
                self._fail(req, self.failure or "the engine stopped")
            except Exception:  # one sink that cannot take its answer must not keep the others waiting
                log.exception("could not tell request %s that the engine stopped", req.seq.request_id)
        if self.failure is not None and self.on_failure is not None:
            self.on_failure(self.failure)

    def _serve(self) -> None:
        intraop.claim()
        self._run_calls(open_after=True)
        while not self._stopping:
            self._wake.clear()
            if self._calls:
                self._run_calls(open_after=True)
            self.clock.begin()  # the whole pass is timed: a hang in scheduling or an import is a hang too
            self._drain_inbox()
            now = time.monotonic()
            plan = self.scheduler.schedule(now) if self.scheduler.has_work else None
            if plan is None or not plan.batch:
                self.clock.end(record=False)
                if self.lockstep:
                    self.runner.idle(self._wake)  # the peers may have work: join their step
                    continue
                wake_at = min([t for t in (self.scheduler.wake_at(), self._fetching.next_deadline()) if t is not None],
                              default=None)
                self._wake.wait(None if wake_at is None else max(0.0, wake_at - now))
                continue
            tokens = sum(item.num_new for item in plan.batch)
            self.clock.size(tokens)
            self._run(plan)
            self._observe(plan)
            self.scheduler.cost.learn(tokens, self.clock.end())

    def _drain_inbox(self) -> None:
        while self._adds:
            req = self._adds.popleft()
            self._requests[req.seq.request_id] = req
            if req.imported is not None:
                self._imports.append(req)
                continue
            self.metrics.prompt_tokens.inc(len(req.seq.prompt_tokens))
            if self._fetching.park(req.seq, self.allocator.cached, self.scheduler.cost.s_per_token):
                continue
            # The window counts from the request's arrival, not from when this thread looked: one that came
            # during a step has waited that step already and departs with the next (from the look, it
            # missed the next step and paid a whole extra step of TTFT whenever the engine was busy).
            self.scheduler.add(req.seq, req.seq.arrival)
        for seq in self._fetching.due(time.monotonic()):
            self.scheduler.add(seq, seq.arrival)
        while self._imports:
            seq = self.scheduler.next_import(req.seq for req in self._imports)
            req = next(r for r in self._imports if r.seq is seq)
            if not self._admit_import(req):
                break
            self._imports.remove(req)
        aborted = bool(self._aborts)
        while self._aborts:
            request_id = self._aborts.popleft()
            seq = self._fetching.drop(request_id) or self.scheduler.abort(request_id)
            req = self._forget(request_id)
            if seq is not None and req is not None:
                self.metrics.requests.labels("aborted").inc()
                req.sink(self._output(req, [], "", "abort"))
        if aborted:
            self._publish_load()

    def _admit_import(self, req: _Request) -> bool:
        """Place a prefilled sequence's KV into fresh blocks and resume it; False to retry later."""
        seq, imp = req.seq, req.imported
        if seq.request_id not in self._requests:  # aborted while waiting
            imp.on_imported()
            return True
        try:
            import_prefilled(self.allocator, self.runner.kv_cache, seq, imp.kv, imp.skipped_blocks)
        except PrefixGone:
            imp.on_imported()
            self.metrics.kv_transfer_recomputes.inc()
            self._recompute_prefilled(req)
            return True
        except OutOfBlocks:
            if self.scheduler.running:
                return False  # blocks free up as running sequences finish
            imp.on_imported()
            self._fail(req, "the prompt's KV does not fit this decode worker's cache")
            return True
        except Exception as exc:  # bytes that do not fit the cache's layout fail this request alone
            imp.on_imported()
            self._fail(req, f"KV import failed: {exc}")
            return True
        imp.on_imported()
        self.metrics.kv_transfer_skipped_blocks.inc(imp.skipped_blocks)
        self.scheduler.adopt(seq)
        seq.imported_at = time.monotonic()
        self._on_token(req, imp.first_token, seq.imported_at, imp.first_logprob)
        return True

    def _recompute_prefilled(self, req: _Request) -> None:
        """The blocks prefill skipped were evicted here before the request arrived: its first token goes out as
        prefill sampled it, and this worker computes the prompt again (from what its prefix cache still holds), as
        for a preempted sequence."""
        seq, imp = req.seq, req.imported
        self.scheduler.adopt(seq)
        self._on_token(req, imp.first_token, time.monotonic(), imp.first_logprob)
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.recompute(seq)

    def _hand_off(self, req: _Request, tok: int, now: float, logprob: Logprob | None) -> None:
        """Prefill role: export the prompt's blocks, report the first token, finish here."""
        seq = req.seq
        try:
            result = hand_off(self.allocator, self.runner.kv_cache, seq, tok, logprob)
        except Exception as exc:
            self.scheduler.abort(seq.request_id)
            self._fail(req, f"KV export failed: {exc}")
            return
        self.metrics.ttft.observe(now - seq.arrival)
        req.first_token_at = now
        self.scheduler.finish(seq, "handoff")
        self._forget(seq.request_id)
        self.metrics.requests.labels("handoff").inc()
        out = self._output(req, [], "", "handoff")
        out.handoff = result
        req.sink(out)

    def _run(self, plan: StepPlan) -> None:
        steps = [self._step(item.seq, item.num_new) for item in plan.batch]
        done = [item for item in plan.batch if item.completes]
        self.metrics.prefill_tokens.inc(
            sum(i.num_new for i in plan.batch if not (i.num_new == 1 and i.completes and i.seq.output_tokens))
        )
        began = time.monotonic()
        for item in plan.batch:
            if item.seq.scheduled_at is None:
                item.seq.scheduled_at = began
        try:
            logits = self.runner.step(steps)
            rows = [i for i, item in enumerate(plan.batch) if item.completes]
            if len(rows) != len(plan.batch):
                logits = logits.index_select(0, to_device(rows, torch.int64, logits.device))
            sampled = sample(logits, [i.seq.params for i in done], [i.seq.seed for i in done],
                            [len(i.seq.output_tokens) for i in done])
        except Exception as exc:  # a failed step fails its requests with the reason, never silently
            log.exception("engine step failed")
            for item in plan.batch:
                self.scheduler.abort(item.seq.request_id)
                req = self._requests.get(item.seq.request_id)
                if req is not None:
                    self._fail(req, f"engine step failed: {exc}")
            return
        self.scheduler.advance(plan)
        now = time.monotonic()
        for item, (tok, logprob) in zip(done, sampled):
            req = self._requests[item.seq.request_id]
            if tok is None:  # this request's sampling had no valid distribution: it fails alone
                self.scheduler.abort(item.seq.request_id)
                self._fail(req, "sampling failed: the model gave no finite scores for these sampling parameters")
                continue
            self._on_token(req, tok, now, logprob)

    def _step(self, seq: Sequence, num_new: int) -> SeqStep:
        tokens = _slice(seq, seq.num_computed, num_new)
        spliced = self._requests[seq.request_id].spliced
        embeds = None if spliced is None else step_embeds(spliced, self.model.embed, seq.num_computed, tokens)
        return SeqStep(tokens, seq.num_computed, seq.block_table, embeds)

    def _on_token(self, req: _Request, tok: int, now: float, logprob: Logprob | None) -> None:
        seq = req.seq
        if seq.handoff is not None:
            self._hand_off(req, tok, now, logprob)
            return
        seq.output_tokens.append(tok)
        m = self.metrics
        m.generation_tokens.inc()
        if req.first_token_at is None:
            req.first_token_at = now
            m.ttft.observe(now - seq.arrival)
        else:
            m.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        text = req.text
        reason = finish_reason(tok, len(seq.output_tokens), text is not None and text.push(tok), seq.params, self.eos_ids)
        logprobs = None if logprob is None else [logprob]
        if reason is None:
            req.sink(self._output(req, [tok], "" if text is None else text.delta(), None, logprobs=logprobs))
            return
        final = "" if text is None else text.rest(seq.output_tokens)
        new = [] if (not seq.params.ignore_eos and tok in self.eos_ids) else [tok]
        if not new:
            seq.output_tokens.pop()
        self.scheduler.finish(seq, reason)
        self._forget(seq.request_id)
        n = len(seq.output_tokens)
        m.e2e.observe(now - seq.arrival)
        if n > 1:
            m.tpot.observe((now - req.first_token_at) / (n - 1))
        m.requests.labels(reason).inc()
        req.sink(self._output(req, new, final, reason, logprobs=logprobs if new else None))

    def _forget(self, request_id: str) -> _Request | None:
        """A request leaves the engine: its tokens no longer count against its client."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._release(req)
        return req

    def _release(self, req: _Request) -> None:
        self.client_tokens.give(req.seq.client, req.open_tokens)
        req.open_tokens = 0

    def _fail(self, req: _Request, why: str) -> None:
        self._requests.pop(req.seq.request_id, None)
        self._release(req)  # also a request that never reached the engine thread (it stopped first)
        self.metrics.requests.labels("error").inc()
        req.sink(self._output(req, [], "", "error", error=why))

    def _output(self, req: _Request, tokens: list[int], text: str, reason: str | None, error: str | None = None,
                logprobs: list[Logprob] | None = None) -> RequestOutput:
        seq = req.seq
        timeline = None
        if reason is not None:  # the last output: the request's times, for its trace (engine/telemetry/tracing.py)
            now = time.time_ns()
            timeline = Timeline(wall_ns(seq.arrival), wall_ns(seq.departed_at), wall_ns(seq.imported_at),
                                wall_ns(seq.scheduled_at), wall_ns(req.first_token_at),
                                now if reason == "handoff" else 0, now)
        return RequestOutput(seq.request_id, tokens, text, reason, len(seq.prompt_tokens), len(seq.output_tokens),
                             seq.num_cached_prompt, error, seed=seq.seed, logprobs=logprobs, timeline=timeline)

    def _observe(self, plan: StepPlan) -> None:
        m, stats = self.metrics, self.scheduler.prefix_stats
        m.batch_size.observe(len(plan.batch))
        if plan.departed:
            m.departure_size.observe(plan.departed)
        if plan.preempted:
            m.preemptions.inc(plan.preempted)
        m.prefix_queried.inc(stats.queried - self._seen_prefix[0])
        m.prefix_hit.inc(stats.hit - self._seen_prefix[1])
        self._seen_prefix = (stats.queried, stats.hit)
        self._publish_load()

    def _publish_load(self) -> None:
        """Load figures the balancers and the autoscaler read (/internal/stats, gauges): after every step,
        and after aborts, which free blocks with no step to follow when the engine goes idle."""
        m = self.metrics
        m.queue_depth.set(self.num_queued)
        m.running.set(len(self.scheduler.running))
        self.stats = {"queued": self.num_queued, "running": len(self.scheduler.running),
                      "kv_blocks_free": self.allocator.num_free,
                      "queued_prefill_tokens": sum(s.num_uncomputed for s in self.scheduler.waiting)}
        m.kv_used.set(self.allocator.num_used)
        m.kv_free.set(self.allocator.num_free)


def _slice(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.tokens[start:start+n] without concatenating prompt and output (the decode hot path)."""
    p = len(seq.prompt_tokens)
    if start >= p:
        return seq.output_tokens[start - p : start - p + n]
    if start + n <= p:
        return seq.prompt_tokens[start : start + n]
    return seq.prompt_tokens[start:] + seq.output_tokens[: start + n - p]


def _seed(params: SamplingParams, resume: Resume | None) -> int | None:
    """A resumed request keeps drawing from its first worker's seed; a new one resolves its own."""
    if resume is not None and resume.seed is not None:
        return resume.seed
    return resolve_seed(params)
