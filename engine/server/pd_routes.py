"""Internal routes of disaggregated roles: /internal/prefill on prefill workers, /internal/decode on decode.

The router calls them: prefill answers with the first token and where its KV waits; decode pulls
that KV (bounded by a timeout, off the engine thread) and answers the client's request in the
OpenAI format, as /v1/... would.
"""

from __future__ import annotations

import asyncio
import time

from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.encoder.splice import SplicedPrompt, spliced_prompt
from engine.server.faults import FaultInjector
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestStream
from engine.core.pd import Handoff
from engine.core.pd_messages import DecodeRequest, PrefillRequest, new_transfer_id
from engine.api.errors import APIError
from engine.api.heartbeat import HEARTBEAT_HEADERS, JSON_HEARTBEAT, paced
from engine.api.protocol import ErrorDetail, ErrorResponse
from engine.api.auth import BearerAuth
from engine.api.requests import check_model, check_priority, check_token_ids, params_for, parse_body
from engine.transfer import KVTransferError, TransportKind, make_receiver, make_sender
from engine.telemetry import tracing

KV_FETCH_TIMEOUT_S = 30.0


def pd_routes(engine: LLMEngine, model_name: str, transport: TransportKind, respond_completion, respond_chat,
              host: str = "127.0.0.1", fetch_timeout_s: float = KV_FETCH_TIMEOUT_S,
              *, auth: BearerAuth, faults: FaultInjector | None = None) -> APIRouter:
    """`host` is where the TCP transport serves staged KV (the worker's own address); `auth` names whom a request
    is for and bounds its priority (a request the router forwards was bounded there); `faults` (tests and
    drills only) slows the decode role's streams as it slows the colocated routes."""
    faults = faults or FaultInjector()
    routes = APIRouter()
    sender = make_sender(transport, host=host)
    receiver = make_receiver(transport)

    def spliced(body: PrefillRequest | DecodeRequest) -> SplicedPrompt | None:
        """The prompt's embeddings with the encoder's images in place (None for text-only prompts)."""
        if not body.images:
            return None
        try:
            return spliced_prompt(body.prompt_token_ids, body.images, engine.model.embed)
        except ValueError as exc:
            raise APIError(400, str(exc), param="images", code="invalid_value") from None

    @routes.post("/internal/prefill")
    async def prefill(body: PrefillRequest, request: Request) -> StreamingResponse:
        """The HandoffResult as JSON, after a space each HEARTBEAT_S while the engine is at work
        (engine/api/heartbeat.py): a long prompt and a stopped member look different to the router. Refusals
        come before the answer starts, with their status; an engine failure after it is the body {"error": ...}."""
        parsed = parse_body("chat/completions" if "messages" in body.request else "completions", body.request)
        check_priority(parsed.priority, auth.priority_floor(request))
        check_model(parsed.model, model_name)
        check_token_ids(body.prompt_token_ids + _resumed(body), engine.vocab_size)
        params = params_for(parsed, len(body.prompt_token_ids), engine)
        handoff = Handoff(sender, new_transfer_id(), body.skip_blocks)
        stream = engine.stream(body.prompt_token_ids, params, handoff=handoff, images=spliced(body), resume=body.resume,
                               client=auth.client_of(request))
        return StreamingResponse(_handoff_json(engine, stream), media_type="application/json", headers=HEARTBEAT_HEADERS)

    @routes.post("/internal/decode")
    async def decode(body: DecodeRequest, request: Request):
        parsed = parse_body(body.api, body.request)
        check_priority(parsed.priority, auth.priority_floor(request))
        check_model(parsed.model, model_name)
        check_token_ids(body.prompt_token_ids + _resumed(body), engine.vocab_size)
        params = params_for(parsed, len(body.prompt_token_ids), engine)
        images = spliced(body)
        started = time.monotonic()
        pull = {"kv.transport": body.descriptor.transport, "kv.bytes": body.descriptor.nbytes}
        with tracing.tracer().start_as_current_span("kv.pull", attributes=pull):
            try:
                kv = await asyncio.to_thread(receiver.fetch, body.descriptor, fetch_timeout_s)
            except KVTransferError as exc:
                engine.metrics.kv_transfer_failures.inc()
                raise APIError(502, str(exc), code="kv_transfer_failed") from None
        engine.metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        engine.metrics.kv_transfer_bytes.inc(kv.nbytes)

        def release() -> None:
            kv.release()
            receiver.release(body.descriptor)

        stream = faults.slow(engine.stream_prefilled(body.prompt_token_ids, params, body, kv, release, images,
                                                     body.resume, client=auth.client_of(request)))
        respond = respond_chat if body.api == "chat/completions" else respond_completion
        return await respond(parsed, request, stream, body.prompt_token_ids, _resumed(body))

    return routes


async def _handoff_json(engine: LLMEngine, stream: RequestStream) -> AsyncIterator[bytes]:
    ended = False
    try:
        async for out in paced(stream, heartbeats=True):
            if out is None:
                if engine.live():
                    yield JSON_HEARTBEAT
                continue
            if out.error is not None or out.handoff is not None or out.finished:
                ended = out.finished or out.error is not None
                if out.handoff is not None:
                    yield out.handoff.model_dump_json().encode()
                else:
                    why = out.error or "prefill ended without a handoff"
                    yield ErrorResponse(error=ErrorDetail(message=why, type="server_error",
                                                          code="engine_error")).model_dump_json().encode()
                return
    finally:
        if not ended:  # the router went away (or the answer failed to be sent): nothing more is computed for it
            engine.abort(stream.request_id)


def _resumed(body: PrefillRequest | DecodeRequest) -> list[int]:
    return [] if body.resume is None else body.resume.output_token_ids
