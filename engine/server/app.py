"""FastAPI app factory: the OpenAI-compatible routes over one LLMEngine, plus health and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.api.cpu_pool import CpuPool
from engine.api.heartbeat import HEARTBEAT_HEADERS, SSE_HEARTBEAT, paced
from engine.server.faults import FaultInjector
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput, RequestStream
from engine.core.sampling_params import Logprob
from engine.server.standby import InstanceState, ServingSwitch
from engine.server.admin_routes import admin_routes
from engine.api.auth import ApiKey, BearerAuth, KeySource, publish_openapi
from engine.api.errors import APIError, error_response, install_error_handlers
from engine.api.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit
from engine.server.logprobs import LogprobText
from engine.core.resume import TRACE_FIELD, TRACE_HEADER, ResumeRequest
from engine.server.pd_routes import pd_routes
from engine.api.requests import check_model, check_priority, check_token_ids, params_for, parse_body, prepare
from engine.transfer import TransportKind
from engine.telemetry.tracing import FASTAPI_OWN_TELEMETRY_OFF, TraceRequests, set_request_id
from engine.api.protocol import (
    ChatChoice, ChatCompletionChunk, ChatLogprobs, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatMessageOut,
    ChatStreamChoice, CompletionChoice, CompletionRequest, CompletionResponse, ErrorDetail, ErrorResponse, ModelCard, ModelList,
    new_id, usage,
)

log = logging.getLogger(__name__)


PREPARE_WORKERS, PREPARE_QUEUE = 2, 256  # a member's prompt threads, and the prompts that may wait for them


def create_app(engine: LLMEngine, model_name: str, api_keys: list[str | ApiKey] | KeySource | None = None, warm_up: bool = True,
               transport: TransportKind | None = None, faults: FaultInjector | None = None,
               standby: bool = False, host: str = "127.0.0.1", max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """The app starts the engine thread and warms it up in the background; /ready turns 200 after.

    `faults` (tests and drills only) fails or slows the completion and chat routes on purpose.
    `standby`: warm up, then release the KV cache and wait silent for POST /admin/activate.
    """
    switch = ServingSwitch(engine)
    faults = faults or FaultInjector()
    auth = BearerAuth(api_keys or [])
    if not auth.enabled:
        log.warning("no API keys configured: every route is open (set TIDEFLOW_API_KEYS or --api-key-file)")

    # Templating and tokenizing a prompt run here: 2 threads at most, as the router's prompt workers. Four chats of
    # 8,192 messages on as many threads held a 2-core member's /health for 322 ms (the GIL, shared 4 ways)
    cpu = CpuPool(PREPARE_WORKERS, PREPARE_QUEUE, name="member")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if warm_up:
            threading.Thread(target=_warm, args=(switch, standby), name="tideflow-warm-up", daemon=True).start()
        try:
            yield
        finally:
            engine.stop()
            cpu.close()

    app = FastAPI(title="tideflow engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=FASTAPI_OWN_TELEMETRY_OFF)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, read_timeout_s=body_timeout_s)
    app.add_middleware(TraceRequests)  # outermost: its span covers the whole answer
    publish_openapi(app, auth)
    install_error_handlers(app, on_error=engine.count_http_error)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "alive"}

    async def require_ready() -> None:  # async: a sync dependency would cost a thread-pool hop
        if not engine.ready:
            raise APIError(503, "the model is loading or warming up; retry shortly", code="not_ready")

    open_routes = APIRouter(dependencies=[Depends(auth)])
    served = APIRouter(dependencies=[Depends(auth), Depends(require_ready)])

    @app.get("/ready")  # open like /health: Kubernetes probes carry no secrets; it only says ready or not
    async def ready() -> JSONResponse:
        if switch.state == InstanceState.STANDBY:  # loaded and warm: the group manager counts it as ready
            return JSONResponse({"status": "standby", "model": model_name})
        if not engine.ready:
            return error_response(503, "the model is loading or warming up", code="not_ready")
        if not engine.live():  # a hung step: routers eject it and the controller rebuilds its group
            return error_response(503, "the engine is stuck in one step, past what its steps take", code="engine_stuck")
        return JSONResponse({"status": "ready", "model": model_name})

    @open_routes.get("/internal/stats")
    async def stats() -> dict:
        """Load figures the router's balancers read."""
        return {"ready": engine.ready, **engine.stats}

    @open_routes.get("/internal/kv-events")
    async def kv_events(epoch: str = Query("", max_length=64), after: int = Query(0, ge=0)) -> Response:
        """What this member's KV holds, as events after the reader's cursor (the router's precise KV routing)."""
        page = getattr(engine, "kv_event_page", None)  # an engine core in its own process does not publish them
        found = None if page is None else await asyncio.to_thread(page, epoch, after)
        if found is None:
            return error_response(404, "this member publishes no KV events (no prefix cache, or an engine core in a "
                                       "process of its own)", code="no_kv_events")
        return Response(found.model_dump_json(), media_type="application/json")

    @open_routes.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await asyncio.to_thread(engine.render_metrics)  # a core in its own process: a round trip
        return Response(body, media_type=content_type)

    @served.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name)])

    logprob_text = LogprobText(engine.tokenizer)

    async def respond_completion(body: CompletionRequest, request: Request, stream: RequestStream, prompt: list[int],
                                 resumed: list[int] | None = None):
        """`resumed`: the tokens another worker streamed before this one took the request over: text offsets
        count from the end of their text, so the client's offsets run on across the handover."""
        rid = new_id("cmpl")
        set_request_id(rid)
        start = logprob_text.chars(resumed) if resumed and body.logprobs is not None else 0
        if body.stream:
            offset = start  # characters of the tokens reported so far

            def chunk(out: RequestOutput) -> str:
                nonlocal offset
                logprobs = None
                if out.logprobs is not None:
                    logprobs = logprob_text.completion(out.token_ids, out.logprobs, offset)
                    offset += logprob_text.chars(out.token_ids)
                return CompletionResponse(id=rid, model=model_name, choices=[
                    CompletionChoice(text=out.text, logprobs=logprobs, finish_reason=_reason(out))
                ]).model_dump_json(exclude_none=True)

            def last(out: RequestOutput) -> str:
                return CompletionResponse(id=rid, model=model_name, choices=[],
                                          usage=usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)).model_dump_json()

            return _sse(engine, stream, None, chunk, last if body.include_usage else None, _trace(request, prompt))
        text, out, tokens, logprobs = await _collect(engine, stream, request)
        made = None if body.logprobs is None else logprob_text.completion(tokens, logprobs, start)
        return CompletionResponse(id=rid, model=model_name, usage=usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens),
                                  choices=[CompletionChoice(text=text, logprobs=made, finish_reason=_reason(out))])

    async def respond_chat(body: ChatCompletionRequest, request: Request, stream: RequestStream, prompt: list[int],
                           resumed: list[int] | None = None):
        rid = new_id("chatcmpl")
        set_request_id(rid)
        if body.stream:
            def make(delta: ChatDelta, reason: str | None, logprobs: ChatLogprobs | None = None) -> str:
                return ChatCompletionChunk(id=rid, model=model_name, choices=[
                    ChatStreamChoice(delta=delta, logprobs=logprobs, finish_reason=reason)
                ]).model_dump_json(exclude_none=True)

            def chunk(out: RequestOutput) -> str:
                logprobs = None if out.logprobs is None else logprob_text.chat(out.token_ids, out.logprobs)
                return make(ChatDelta(content=out.text), _reason(out), logprobs)

            def last(out: RequestOutput) -> str:
                return ChatCompletionChunk(id=rid, model=model_name, choices=[],
                                           usage=usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)).model_dump_json()

            return _sse(engine, stream, make(ChatDelta(role="assistant", content=""), None), chunk,
                        last if body.include_usage else None, _trace(request, prompt))
        text, out, tokens, logprobs = await _collect(engine, stream, request)
        made = logprob_text.chat(tokens, logprobs) if body.logprobs else None
        return ChatCompletionResponse(
            id=rid, model=model_name, usage=usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens),
            choices=[ChatChoice(message=ChatMessageOut(content=text), logprobs=made, finish_reason=_reason(out))],
        )

    def allowed(body: CompletionRequest | ChatCompletionRequest, request: Request) -> None:
        check_priority(body.priority, auth.priority_floor(request))

    @served.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        allowed(body, request)
        prompt, params = await cpu.run(prepare, engine, model_name, body)  # tokenizing: off the event loop
        faults.check()
        return await respond_completion(body, request, faults.slow(engine.stream(prompt, params,
                                                                                  client=auth.client_of(request))), prompt)

    @served.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        allowed(body, request)
        prompt, params = await cpu.run(prepare, engine, model_name, body)
        faults.check()
        return await respond_chat(body, request, faults.slow(engine.stream(prompt, params, client=auth.client_of(request))),
                                  prompt)

    @served.post("/internal/resume")
    async def resume(body: ResumeRequest, request: Request):
        """A request whose worker failed mid-stream, continued here (the router migrates it)."""
        parsed = parse_body(body.api, body.request)
        allowed(parsed, request)
        check_model(parsed.model, model_name)
        check_token_ids(body.prompt_token_ids + body.resume.output_token_ids, engine.vocab_size)
        params = params_for(parsed, len(body.prompt_token_ids), engine)
        faults.check()
        stream = faults.slow(engine.stream(body.prompt_token_ids, params, resume=body.resume, client=auth.client_of(request)))
        respond = respond_chat if body.api == "chat/completions" else respond_completion
        return await respond(parsed, request, stream, body.prompt_token_ids, body.resume.output_token_ids)

    if transport is not None:
        served.include_router(pd_routes(engine, model_name, transport, respond_completion, respond_chat, host,
                                        faults=faults, auth=auth))

    app.include_router(open_routes)
    app.include_router(admin_routes(switch), dependencies=[Depends(auth)])
    app.include_router(served)
    return app


def _warm(switch: ServingSwitch, standby: bool) -> None:
    try:
        switch.warm(standby)
    except Exception:
        log.exception("warm-up failed: the engine stays not ready")


def _reason(out: RequestOutput) -> str | None:
    """OpenAI finish reasons: stop, length; an aborted request ends as stop of what was generated."""
    return None if out.finish_reason is None else ("length" if out.finish_reason == "length" else "stop")


async def _collect(engine: LLMEngine, stream: RequestStream,
                   request: Request) -> tuple[str, RequestOutput, list[int], list[Logprob]]:
    """Gather a whole response: its text, last output, token ids and (when asked for) their Logprobs; a client that
    goes away cancels the request (frees its blocks)."""
    watcher = asyncio.create_task(_abort_on_disconnect(engine, stream.request_id, request))
    parts: list[str] = []
    tokens: list[int] = []
    logprobs: list[Logprob] = []
    last: RequestOutput | None = None
    try:
        async for out in stream:
            parts.append(out.text)
            if out.logprobs is not None:
                tokens += out.token_ids
                logprobs += out.logprobs
            last = out
    finally:
        watcher.cancel()
        if last is None or not last.finished:
            engine.abort(stream.request_id)
    if last.error is not None:
        raise APIError(500, last.error, code="engine_error")
    return "".join(parts), last, tokens, logprobs


async def _abort_on_disconnect(engine: LLMEngine, request_id: str, request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.abort(request_id)
            return


def _trace(request: Request, prompt: list[int]) -> list[int] | None:
    """The prompt's token ids when the caller (the router) asked for token ids in the stream."""
    return prompt if request.headers.get(TRACE_HEADER) == "1" else None


def _traced(data: str, trace: dict) -> str:
    """`data` (a JSON object) with the trace field added: the router reads and strips it."""
    return f'{data[:-1]},"{TRACE_FIELD}":{json.dumps(trace, separators=(",", ":"))}}}'


def _sse(engine: LLMEngine, stream: RequestStream, first: str | None, chunk, last,
         trace_prompt: list[int] | None = None) -> StreamingResponse:
    """Server-sent events: one chunk per output with text; closing the stream cancels the request.
    With `trace_prompt`, every output is sent (text or not) carrying its token ids, so the router can
    resume the request elsewhere; the first event also carries the prompt's token ids."""
    traced = trace_prompt is not None

    async def events() -> AsyncIterator[str]:
        finished = False
        pending_prompt = trace_prompt
        try:
            if first is not None:
                if traced:
                    first_event, pending_prompt = _traced(first, {"prompt_token_ids": trace_prompt}), None
                else:
                    first_event = first
                yield f"data: {first_event}\n\n"
            async for out in paced(stream, traced):
                if out is None:  # nothing to send for HEARTBEAT_S: say the engine is at work, if it is
                    if engine.live():
                        yield SSE_HEARTBEAT
                    continue
                if out.error is not None:
                    error = ErrorResponse(error=ErrorDetail(message=out.error, type="server_error", code="engine_error"))
                    yield f"data: {error.model_dump_json()}\n\n"
                    finished = True
                    break
                if out.text or out.finished or out.logprobs or (traced and out.token_ids):
                    data = chunk(out)
                    if traced:
                        trace = {"token_ids": out.token_ids, "seed": out.seed}
                        if pending_prompt is not None:
                            trace["prompt_token_ids"], pending_prompt = pending_prompt, None
                        data = _traced(data, trace)
                    yield f"data: {data}\n\n"
                if out.finished:
                    finished = True
                    if last is not None:
                        yield f"data: {last(out)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                engine.abort(stream.request_id)

    headers = {"Cache-Control": "no-cache", **(HEARTBEAT_HEADERS if traced else {})}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
