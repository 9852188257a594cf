"""One client request through the group set: pick a group, run its stages, relay the stream.

Colocated groups get the client's request as it came. Disaggregated groups run the stages
themselves: prefill (prefix-affinity LB) computes the KV cache and the first token, decode
(KV-aware LB) pulls that KV and streams the rest. A stage that fails before any byte reached
the client is retried elsewhere (bounded); after that, the client gets an error event. Chat
requests with images, in groups with an encoder role, first get their embeddings from the
encoder LB; prefill and decode receive them with the prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx
from fastapi.responses import Response, StreamingResponse

from engine.kv_cache import block_hash
from engine.router.balancer import DecodeBalancer, LeastQueuedBalancer, PrefillBalancer
from engine.router.config import RouterConfig
from engine.router.health import HealthMonitor
from engine.router.images import ImagePrompts
from engine.router.metrics import RouterMetrics
from engine.router.registry import EndpointState, GroupState, Registry
from engine.server.errors import error_response


class UpstreamFailed(Exception):
    """Retryable: nothing reached the client yet."""


class UpstreamRejected(Exception):
    """The upstream refused the request itself (4xx): passed to the client as is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


@dataclass
class Opened:
    """An upstream response whose status is OK and whose first event (if streaming) is buffered."""

    response: httpx.Response
    head: list[str] = field(default_factory=list)
    body: bytes | None = None
    endpoints: list[EndpointState] = field(default_factory=list)


class Proxy:
    def __init__(self, config: RouterConfig, registry: Registry, client: httpx.AsyncClient, metrics: RouterMetrics,
                 prepare_prompt, upstream_headers: dict[str, str]) -> None:
        self.config, self.registry, self.client, self.metrics = config, registry, client, metrics
        self.prepare_prompt = prepare_prompt  # (api, body) -> prompt token ids, for PD groups
        self.headers = upstream_headers
        self.prefill_lb = PrefillBalancer(config.affinity_threshold_tokens)
        self.decode_lb = DecodeBalancer()
        self.colocated_lb = LeastQueuedBalancer()
        self.encoder_lb = LeastQueuedBalancer()
        self.images = ImagePrompts(config.model_dir) if config.model_dir else None

    async def serve(self, api: str, body: dict, raw: bytes) -> Response:
        t0 = time.monotonic()
        deadline = t0 + self.config.request_timeout_s
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        last = "no group is ready to serve"
        for attempt in range(self.config.max_attempts):
            group = self.registry.choose(exclude=tried) or (self.registry.choose() if tried else None)
            if group is None:
                break
            tried.add(group.reg.name)
            if attempt:
                self.metrics.retries(group).inc()
            group.inflight += 1
            try:
                opened = await self._open(group, api, body, raw, stream, deadline)
            except UpstreamFailed as exc:
                group.inflight -= 1
                last = str(exc)
                continue
            except UpstreamRejected as exc:
                group.inflight -= 1
                self.metrics.requests(group, "rejected").inc()
                return Response(exc.body, status_code=exc.status, media_type="application/json")
            except BaseException:
                group.inflight -= 1
                raise
            if stream:
                return StreamingResponse(self._relay(group, opened, t0, deadline), media_type="text/event-stream")
            return self._finish_json(group, opened, t0)
        self.metrics.unrouted.inc()
        return error_response(503, f"request failed on every try: {last}", code="upstream_unavailable")

    async def _open(self, group: GroupState, api: str, body: dict, raw: bytes, stream: bool, deadline: float) -> Opened:
        if not group.disaggregated:
            target = self.colocated_lb.choose(group.by_role("colocated") or _fail("no healthy colocated member"))
            return await self._post(target, f"/v1/{api}", raw, stream, deadline)
        urls = self.images.urls(api, body, raw) if self.images is not None else []
        if urls and any(e.endpoint.role == "encoder" for e in group.endpoints):
            encoded = await self._encode(group, urls, deadline)
            prompt, placed, extras = self.images.prompt(body, encoded, self.config.block_size)
            images = [p.model_dump() for p in placed]
        else:  # text only; images without an encoder role are refused by prepare_prompt
            prompt, images, extras = self.prepare_prompt(api, body), [], {}
        hashes = _block_hashes(prompt, self.config.block_size, extras)
        prefill = await self._prefill(group, prompt, body, hashes, deadline, images)
        decode_body = json.dumps({"api": api, "request": body, "prompt_token_ids": prompt, "images": images,
                                  **prefill}).encode()
        target = self.decode_lb.choose(group.by_role("decode") or _fail("no healthy decode member"))
        return await self._post(target, "/internal/decode", decode_body, stream, deadline)

    async def _encode(self, group: GroupState, urls: list[str], deadline: float) -> list[dict]:
        """Bounded retries across the group's encoders (fewest queued images first); their embeddings."""
        last = "no healthy encoder member"
        content = json.dumps({"images": urls}).encode()
        for _ in range(self.config.max_attempts):
            candidates = group.by_role("encoder")
            if not candidates:
                break
            target = self.encoder_lb.choose(candidates)
            try:
                opened = await self._post(target, "/internal/encode", content, False, deadline)
            except UpstreamFailed as exc:
                last = str(exc)
                continue
            return json.loads(opened.body)["images"]
        raise UpstreamFailed(last)

    async def _prefill(self, group: GroupState, prompt: list[int], body: dict, hashes: list[int], deadline: float,
                       images: list[dict]) -> dict:
        """Bounded retries across the group's prefill instances; returns the handover for decode."""
        last = "no healthy prefill member"
        for _ in range(self.config.max_attempts):
            candidates = group.by_role("prefill")
            if not candidates:
                break
            target = self.prefill_lb.choose(candidates, hashes)
            target.queued_prefill_tokens += len(prompt)
            try:
                opened = await self._post(target, "/internal/prefill",
                                          json.dumps({"prompt_token_ids": prompt, "request": body, "images": images}).encode(),
                                          False, deadline)
            except UpstreamFailed as exc:
                last = str(exc)
                continue
            finally:
                target.queued_prefill_tokens -= len(prompt)
            self.prefill_lb.record(target, hashes)
            return json.loads(opened.body)
        raise UpstreamFailed(last)

    async def _post(self, target: EndpointState, path: str, content: bytes, stream: bool, deadline: float) -> Opened:
        url = target.endpoint.url + path
        remaining = max(0.1, deadline - time.monotonic())
        timeout = httpx.Timeout(min(self.config.first_token_timeout_s, remaining), connect=self.config.connect_timeout_s)
        # In-flight accounting: incremented here once, decremented once: in `finally` below, unless an open
        # stream is handed to _relay, which decrements when the stream ends.
        target.inflight += 1
        handed_over = False
        try:
            request = self.client.build_request("POST", url, content=content, timeout=timeout,
                                                headers={**self.headers, "content-type": "application/json"})
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TimeoutException:
                raise UpstreamFailed(f"{url} did not answer within {timeout.read:.0f}s") from None
            except httpx.ConnectError as exc:
                # nothing listens: the member is gone. Any other failure is one request's, and ejection
                # stays with the health monitor (one client cannot take a group out of routing).
                HealthMonitor.eject(target, f"connection failed: {exc.__class__.__name__}")
                raise UpstreamFailed(f"{url}: {exc.__class__.__name__}") from None
            except httpx.TransportError as exc:
                raise UpstreamFailed(f"{url}: {exc.__class__.__name__}") from None
            try:
                if response.status_code >= 500:
                    text = (await response.aread()).decode(errors="replace")[:300]
                    raise UpstreamFailed(f"{url} answered {response.status_code}: {text}")
                if response.status_code >= 400:
                    raise UpstreamRejected(response.status_code, await response.aread())
                if not stream:
                    return Opened(response, body=await response.aread(), endpoints=[target])
                head = await self._read_head(response, deadline)
                handed_over = True
                return Opened(response, head=head, endpoints=[target])
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                raise UpstreamFailed(f"{url} broke before its first event: {exc.__class__.__name__}") from None
            finally:
                if not handed_over:
                    await response.aclose()
        finally:
            if not handed_over:
                target.inflight -= 1

    async def _read_head(self, response: httpx.Response, deadline: float) -> list[str]:
        """Lines up to and including the first data event, so a failure here is still retryable."""
        lines: list[str] = []
        iterator = response.aiter_lines()
        response.extensions["tideflow_lines"] = iterator
        while True:
            try:
                line = await asyncio.wait_for(iterator.__anext__(), timeout=max(0.1, deadline - time.monotonic()))
            except StopAsyncIteration:
                raise UpstreamFailed("the upstream stream ended before its first event") from None
            lines.append(line)
            if line.startswith("data:"):
                if '"error"' in line[:20]:
                    raise UpstreamFailed(f"upstream error before the first token: {line[5:].strip()[:300]}")
                return lines

    async def _relay(self, group: GroupState, opened: Opened, t0: float, deadline: float) -> AsyncIterator[str]:
        meter = StreamMeter(t0)
        status = "error"
        try:
            for line in opened.head:
                meter.see(line)
                yield line + "\n"
            iterator = opened.response.extensions["tideflow_lines"]
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                async for line in iterator:
                    meter.see(line)
                    yield line + "\n"
            status = "error" if meter.errored else "ok"
        except (httpx.HTTPError, TimeoutError, asyncio.TimeoutError) as exc:
            status = "timeout" if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) else "error"
            why = "request deadline passed" if status == "timeout" else f"upstream failed mid-stream: {exc.__class__.__name__}"
            yield f'data: {json.dumps({"error": {"message": why, "type": "server_error", "code": status}})}\n\n'
        finally:
            await opened.response.aclose()
            for e in opened.endpoints:
                e.inflight -= 1
            group.inflight -= 1
            self.metrics.observe(group, status, meter)

    def _finish_json(self, group: GroupState, opened: Opened, t0: float) -> Response:
        group.inflight -= 1
        meter = StreamMeter(t0)
        try:
            meter.tokens = int(json.loads(opened.body)["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            pass
        meter.end = time.monotonic()
        self.metrics.observe(group, "ok", meter)
        return Response(opened.body, media_type="application/json")


class StreamMeter:
    """TTFT, TPOT and token count as seen by the client, from the SSE events relayed."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.first: float | None = None
        self.end: float | None = None
        self.tokens = 0
        self.errored = False

    def see(self, line: str) -> None:
        if not line.startswith("data:"):
            return
        payload = line[5:].strip()
        now = time.monotonic()
        self.end = now
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if "error" in event:
            self.errored = True
            return
        for choice in event.get("choices") or ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                self.tokens += 1
                self.first = self.first or now
        if event.get("usage"):
            self.tokens = max(self.tokens, int(event["usage"].get("completion_tokens", 0)))

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.t0

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)


def _block_hashes(tokens: list[int], block_size: int, extras: dict[int, bytes] | None = None) -> list[int]:
    hashes, prev = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        prev = block_hash(prev, tokens[i : i + block_size], (extras or {}).get(i // block_size, b""))
        hashes.append(prev)
    return hashes


def _fail(why: str):
    raise UpstreamFailed(why)
