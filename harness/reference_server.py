"""An OpenAI-compatible streaming server with configured latencies: the known answer a load drill is checked against.

Each request waits for one of `slots` (so offered load beyond slots / service time queues and TTFT grows, like a
saturated engine), then streams `max_tokens` one-word chunks: the first after `ttft_s`, each next after `tpot_s`.
Prompts containing FAIL get HTTP 500; prompts containing BREAK lose their connection after the first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from engine.api.inproc import serve_in_thread
from engine.api.protocol import (
    ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatStreamChoice, CompletionChoice, CompletionRequest,
    CompletionResponse, ErrorDetail, ErrorResponse, ModelCard, ModelList, new_id, usage,
)


class ReferenceLatency(BaseModel):
    """The latencies the reference server imposes."""

    ttft_s: float = Field(0.05, ge=0, description="wait before the first token, once a slot is held")
    tpot_s: float = Field(0.01, ge=0, description="wait before each later token")
    slots: int = Field(64, ge=1, description="requests served at once; the rest queue")


def create_reference_app(model: str, latency: ReferenceLatency) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    slots = asyncio.Semaphore(latency.slots)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "alive"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model)])

    def check(body_model: str, prompt: str) -> None:
        if body_model != model:
            raise HTTPException(404, f"model {body_model!r} is not served; try {model!r}")
        if "FAIL" in prompt:
            raise HTTPException(500, "injected failure (prompt contains FAIL)")

    @app.exception_handler(HTTPException)
    async def openai_error(request, exc: HTTPException) -> JSONResponse:
        body = ErrorResponse(error=ErrorDetail(message=exc.detail, type="server_error" if exc.status_code >= 500
                                               else "invalid_request_error"))
        return JSONResponse(body.model_dump(), status_code=exc.status_code)

    async def tokens(n: int, prompt: str) -> AsyncIterator[str]:
        async with slots:
            await asyncio.sleep(latency.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(latency.tpot_s)
                yield f"w{i} "
                if "BREAK" in prompt:
                    raise ConnectionAbortedError("injected disconnect (prompt contains BREAK)")

    def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            async for c in chunks:
                yield f"data: {c}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompt = body.prompt if isinstance(body.prompt, str) else " ".join(map(str, body.prompt))
        check(body.model, prompt)
        n, n_prompt, rid = body.max_tokens or 16, len(prompt.split()), new_id("cmpl")

        async def chunks() -> AsyncIterator[str]:
            async for text in tokens(n, prompt):
                yield CompletionResponse(id=rid, model=model, choices=[CompletionChoice(text=text)]).model_dump_json()
            if body.include_usage:
                yield CompletionResponse(id=rid, model=model, choices=[], usage=usage(n_prompt, n)).model_dump_json()

        return sse(chunks())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        prompt = " ".join(m.content for m in body.messages)
        check(body.model, prompt)
        n, n_prompt, rid = body.max_completion_tokens or body.max_tokens or 16, len(prompt.split()), new_id("chatcmpl")

        async def chunks() -> AsyncIterator[str]:
            yield ChatCompletionChunk(id=rid, model=model, choices=[
                ChatStreamChoice(delta=ChatDelta(role="assistant", content=""))]).model_dump_json()
            async for text in tokens(n, prompt):
                yield ChatCompletionChunk(id=rid, model=model, choices=[
                    ChatStreamChoice(delta=ChatDelta(content=text))]).model_dump_json()
            if body.include_usage:
                yield ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage(n_prompt, n)).model_dump_json()

        return sse(chunks())

    return app


def serve_reference(model: str = "reference", latency: ReferenceLatency | None = None):
    """Run the reference server on 127.0.0.1 (free port) in a thread; a context manager yielding its base URL."""
    return serve_in_thread(create_reference_app(model, latency or ReferenceLatency()), "reference-server",
                           loop="asyncio", http="h11")


def main() -> None:
    """`python -m harness.reference_server --port N`: serve until interrupted (for cross-checks from another process)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="reference")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--tpot-ms", type=float, default=10.0)
    p.add_argument("--slots", type=int, default=64)
    args = p.parse_args()
    latency = ReferenceLatency(ttft_s=args.ttft_ms / 1000, tpot_s=args.tpot_ms / 1000, slots=args.slots)
    uvicorn.run(create_reference_app(args.model, latency), host="127.0.0.1", port=args.port, log_level="warning",
                loop="asyncio", http="h11")


if __name__ == "__main__":
    main()
