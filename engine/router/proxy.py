"""One client request through the group set: pick a group, run its stages, relay the stream, migrate it.

Colocated groups get the client's request as it came. Disaggregated groups run the stages
themselves: prefill (prefix-affinity LB) computes the KV cache and the first token, decode
(KV-aware LB) pulls that KV and streams the rest. A stage that fails before any byte reached
the client is retried elsewhere (bounded). Chat requests with images, in groups with an encoder
role, first get their embeddings from the encoder LB; prefill and decode receive them with the prompt.

Every upstream is streamed with token ids traced (engine.router.migration.StreamRecord). When it
breaks after the client got part of its answer (connection lost, member killed, error event, early
end), the request migrates: another group, or another member of the same one, recomputes prompt +
the tokens already sent and goes on from there, up to `migration_limit` times per request. Streaming
and non-streaming clients alike see one unbroken answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import httpx
from opentelemetry import trace
from fastapi.responses import Response, StreamingResponse

from engine.runtime.http import sse_lines
from engine.core.block_hash import block_hash
from engine.core.resume import TRACE_HEADER
from engine.router.balancer import DecodeBalancer, LeastQueuedBalancer
from engine.router.kv_index import KVIndex, KVRouter
from engine.router.config import RouterConfig
from engine.api.cpu_pool import CpuPool
from engine.router.health import HealthMonitor
from engine.router.images import ImagePrompts
from engine.router.metrics import RouterMetrics
from engine.router.migration import StreamRecord, UpstreamBroke
from engine.api.heartbeat import HEARTBEAT_HEADER
from engine.router.registry import EndpointState, GroupState, Registry
from engine.api.auth import CLIENT_HEADER
from engine.api.errors import APIError, error_response
from engine.telemetry import tracing


ROUTE_POLL_S = 0.02  # how often a request waiting for a routable group looks again
# A stall timer that fires this late fired because the router's loop was held up, not the member: the stream still
# moves (its reader was cancelled), but the member is not ejected, so one pause of the router never takes every
# member out of routing at once
ROUTER_LATE_S = 0.25


class UpstreamFailed(Exception):
    """Retryable: nothing reached the client yet."""


class UpstreamRejected(Exception):
    """The upstream refused the request itself (4xx): passed to the client as is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


class StreamLost(Exception):
    """The answer cannot be completed: the client gets this as an error (event or response)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status


@dataclass
class Opened:
    """An upstream response whose status is OK and whose first event (if streaming) is buffered."""

    response: httpx.Response
    head: list[str] = field(default_factory=list)
    body: bytes | None = None
    endpoints: list[EndpointState] = field(default_factory=list)
    stall_s: float | None = None  # the member beats (HEARTBEAT_HEADER): silence this long means it stopped
    answered_at: float = field(default_factory=time.monotonic)  # when the upstream's response head came
    span: trace.Span = trace.INVALID_SPAN  # this call's CLIENT span (engine/telemetry/tracing.py), ended by _close


class OpenRequests:
    """Requests each client has open through this router, capped: one key's flood waits at its own door (429)
    instead of in every member's queue. None: no cap."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.counts: dict[str, int] = {}

    def take(self, client: str) -> bool:
        held = self.counts.get(client, 0)
        if self.cap is not None and held >= self.cap:
            return False
        self.counts[client] = held + 1
        return True

    def give(self, client: str) -> None:
        held = self.counts.get(client, 0) - 1
        if held > 0:
            self.counts[client] = held
        else:
            self.counts.pop(client, None)


class Proxy:
    def __init__(self, config: RouterConfig, registry: Registry, client: httpx.AsyncClient, metrics: RouterMetrics,
                 prepare_prompt, upstream_headers: dict[str, str], cpu: CpuPool, kv_index: KVIndex) -> None:
        self.config, self.registry, self.client, self.metrics = config, registry, client, metrics
        self.prepare_prompt = prepare_prompt  # (api, body) -> prompt token ids, for PD groups
        self.cpu = cpu  # where prompts are tokenized, hashed and serialized (never on the event loop)
        self.headers = upstream_headers
        self.kv_router = KVRouter(config.kv_routing, kv_index, config.block_size)  # colocated and prefill members
        self.decode_lb = DecodeBalancer()
        self.encoder_lb = LeastQueuedBalancer()
        self.images = ImagePrompts(config.model_dir) if config.model_dir else None
        self.open_requests = OpenRequests(config.max_open_per_key)

    async def serve(self, api: str, body: dict, raw: bytes, client: str = "") -> Response:
        """`client` names who asked (engine.api.auth.key_digest of the client's key): members share their
        engines by it, and it counts against the client's cap on open requests."""
        if client and not self.open_requests.take(client):
            return error_response(429, f"this API key has {self.config.max_open_per_key} requests open, the most a key "
                                       "may; wait for some to finish", code="too_many_open_requests")
        release = _once(lambda: self.open_requests.give(client) if client else None)
        try:
            response = await self._serve(api, body, raw, client)
        except BaseException:
            release()
            raise
        if isinstance(response, StreamingResponse):
            return _ReleasingStream(response, release)  # the slot is given back once the answer is over
        release()
        return response

    async def _serve(self, api: str, body: dict, raw: bytes, client: str) -> Response:
        t0 = time.monotonic()
        deadline = t0 + self.config.request_timeout_s
        record = StreamRecord(api, body, t0)
        record.client = client
        record.image_urls = self.images.urls(api, body, raw) if self.images is not None else []
        upstream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        try:
            group, opened = await self._open_any(api, upstream, record, deadline, set())
        except UpstreamRejected as exc:
            return Response(exc.body, status_code=exc.status, media_type="application/json")
        except UpstreamFailed as exc:
            self.metrics.unrouted.inc()
            return error_response(503, f"request failed on every try: {exc}", code="upstream_unavailable")
        events = self._relay(group, opened, api, upstream, record, deadline)
        if record.client_stream:
            return StreamingResponse(_sse(events, record), media_type="text/event-stream")
        try:
            async for _ in events:
                pass
        except StreamLost as exc:
            return error_response(504 if exc.status == "timeout" else 502, str(exc), code=f"upstream_{exc.status}")
        finally:
            await events.aclose()  # a client gone mid-answer: the upstream is closed and the counts released
        return Response(record.answer(), media_type="application/json")

    async def _open_any(self, api: str, upstream: dict, record: StreamRecord, deadline: float,
                        tried: set[str]) -> tuple[GroupState, Opened]:
        """Open the request (or, once started, its resumption) on a group not in `tried` (any group if
        none is left), bounded by max_attempts; the group's in-flight count is taken for the caller.
        While no group is routable (a standby activating after a fall), it waits up to route_wait_s; a try on
        a group whose member turned out gone (ejected by it) does not count against max_attempts meanwhile."""
        last = "no group is ready to serve"
        wait_until = min(deadline, time.monotonic() + self.config.route_wait_s)
        attempt = 0
        while attempt < self.config.max_attempts:
            group = self.registry.choose(exclude=tried) or (self.registry.choose() if tried else None)
            if group is None:
                if time.monotonic() >= wait_until:
                    break
                await asyncio.sleep(ROUTE_POLL_S)
                continue
            tried.add(group.reg.name)
            if attempt:
                self.metrics.retries(group).inc()
            attempt += 1
            group.inflight += 1
            try:
                return group, await self._open(group, api, upstream, record, deadline)
            except UpstreamFailed as exc:
                group.inflight -= 1
                last = str(exc)
                self.metrics.failed_attempt(group)
                if not group.routable and time.monotonic() < wait_until:
                    attempt -= 1  # its member is gone (ejected): that try says nothing of the other groups
            except UpstreamRejected:
                group.inflight -= 1
                self.metrics.requests(group, "rejected").inc()
                raise
            except BaseException:
                group.inflight -= 1
                raise
        raise UpstreamFailed(last)

    async def _open(self, group: GroupState, api: str, upstream: dict, record: StreamRecord, deadline: float) -> Opened:
        resume = record.resume().model_dump() if record.started else None
        if not group.disaggregated:
            candidates = group.by_role("colocated") or _fail("no healthy colocated member")
            hashes = await self._colocated_hashes(api, upstream, record) if len(candidates) > 1 else []
            target = self.kv_router.choose(candidates, hashes, colocated=True)
            self.kv_router.record(target, hashes)
            if resume is None:
                return await self._post(target, f"/v1/{api}", json.dumps(upstream).encode(), True, deadline,
                                        record.client)
            content = {"api": api, "request": upstream, "prompt_token_ids": record.prompt_ids, "resume": resume}
            return await self._post(target, "/internal/resume", json.dumps(content).encode(), True, deadline,
                                    record.client, links=record.resumes())
        if record.prompt_ids is None:
            record.prompt_ids, record.images, record.extras = await self._prompt(group, api, upstream, record.image_urls,
                                                                                 deadline)
            record.block_hashes = await self.cpu.run(_block_hashes, record.prompt_ids, self.config.block_size,
                                                     salted(record.extras, upstream))
        prompt, images = record.prompt_ids, record.images
        target = self.decode_lb.choose(group.by_role("decode") or _fail("no healthy decode member"))
        skip = self.kv_router.held_by(target, record.block_hashes)  # decode is sent only the blocks it lacks
        prefill = await self._prefill(group, prompt, upstream, record.block_hashes, deadline, images, resume,
                                      record.client, skip, record.resumes())
        decode_body = await self.cpu.run(_json, {"api": api, "request": upstream, "prompt_token_ids": prompt,
                                                 "images": images, "resume": resume, **prefill})
        return await self._post(target, "/internal/decode", decode_body, True, deadline, record.client,
                                links=record.resumes())

    async def _colocated_hashes(self, api: str, body: dict, record: StreamRecord) -> list[int]:
        """The block hashes of a colocated request's prompt, to place it by the KV members hold; none when the mode
        needs none, the router has no tokenizer, or the prompt holds images (left to the member to read)."""
        if self.config.kv_routing.mode == "least-queued" or self.config.model_dir is None or record.image_urls:
            return []
        if record.block_hashes:
            return record.block_hashes
        try:
            ids = await self.cpu.run(self.prepare_prompt, api, body)
        except APIError:
            return []  # the member answers the error itself (or a full tokenizing pool sends it unplaced)
        record.block_hashes = await self.cpu.run(_block_hashes, ids, self.config.block_size, salted({}, body))
        return record.block_hashes

    async def _prompt(self, group: GroupState, api: str, body: dict, urls: list[str],
                      deadline: float) -> tuple[list[int], list[dict], dict]:
        """Prompt token ids of a disaggregated request, with the encoder's images placed in it."""
        if urls and any(e.endpoint.role == "encoder" for e in group.endpoints):
            encoded = await self._encode(group, urls, deadline)
            prompt, placed, extras = await self.cpu.run(self.images.prompt, body, encoded, self.config.block_size)
            return prompt, [p.model_dump() for p in placed], extras
        # text only; images without an encoder role are refused by prepare_prompt
        return await self.cpu.run(self.prepare_prompt, api, body), [], {}

    async def _encode(self, group: GroupState, urls: list[str], deadline: float) -> list[dict]:
        """Bounded retries across the group's encoders (fewest queued images first); their embeddings."""
        last = "no healthy encoder member"
        content = json.dumps({"images": urls}).encode()
        for attempt in range(self.config.max_attempts):
            candidates = group.by_role("encoder")
            if not candidates:
                break
            if attempt:
                self.metrics.retries(group).inc()
            target = self.encoder_lb.choose(candidates)
            try:
                opened = await self._post(target, "/internal/encode", content, False, deadline)
            except UpstreamFailed as exc:
                last = str(exc)
                continue
            return json.loads(opened.body)["images"]
        raise UpstreamFailed(last)

    async def _prefill(self, group: GroupState, prompt: list[int], body: dict, hashes: list[int], deadline: float,
                       images: list[dict], resume: dict | None, client: str, skip_blocks: int = 0,
                       links: tuple[trace.SpanContext, ...] = ()) -> dict:
        """Bounded retries across the group's prefill instances; returns the handover for decode. `skip_blocks`:
        the prompt's leading blocks the chosen decode member holds, left out of the transfer."""
        last = "no healthy prefill member"
        content: bytes | None = None
        for attempt in range(self.config.max_attempts):
            candidates = group.by_role("prefill")
            if not candidates:
                break
            if attempt:
                self.metrics.retries(group).inc()
            target = self.kv_router.choose(candidates, hashes, colocated=False)
            target.queued_prefill_tokens += len(prompt)
            try:
                if content is None:
                    content = await self.cpu.run(_json, {"prompt_token_ids": prompt, "request": body, "images": images,
                                                         "resume": resume, "skip_blocks": skip_blocks})
                opened = await self._post(target, "/internal/prefill", content, False, deadline, client, watched=True,
                                          links=links)
                handoff = json.loads(opened.body)
                if not isinstance(handoff, dict):
                    raise ValueError("not an object")
                if "error" in handoff:  # the engine failed after the answer had begun (its status was sent)
                    raise UpstreamFailed(f"prefill failed: {str(handoff['error'])[:300]}")
            except UpstreamFailed as exc:
                last = str(exc)
                continue
            except ValueError:
                last = "prefill answered something that is not a JSON object"
                continue
            finally:
                target.queued_prefill_tokens -= len(prompt)
            self.kv_router.record(target, hashes)
            return handoff
        raise UpstreamFailed(last)

    async def _post(self, target: EndpointState, path: str, content: bytes, stream: bool, deadline: float,
                    client: str = "", watched: bool = False, links: tuple[trace.SpanContext, ...] = ()) -> Opened:
        """`watched` (a whole answer the member paces with heartbeats: prefill): its body may go silent no longer
        than the stall timeout, as a stream may not. `links`: the span of the stream this call resumes (a migration)."""
        url = target.endpoint.url + path
        remaining = max(0.1, deadline - time.monotonic())
        timeout = httpx.Timeout(min(self.config.first_token_timeout_s, remaining), connect=self.config.connect_timeout_s)
        span = tracing.client_span(f"{target.endpoint.role} {path}", {
            "server.address": target.endpoint.url, "tideflow.instance": target.endpoint.instance}, links)
        # In-flight accounting: incremented here once, decremented once: in `finally` below, unless an open
        # stream is handed to _relay, which decrements when the stream ends.
        target.inflight += 1
        handed_over = False
        try:
            headers = tracing.inject({**self.headers, "content-type": "application/json", TRACE_HEADER: "1"}, span)
            if client:
                headers[CLIENT_HEADER] = client
            request = self.client.build_request("POST", url, content=content, timeout=timeout, headers=headers)
            try:
                response = await self._send_unless_ejected(target, request)
                answered_at = time.monotonic()
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
                stall_s = self.config.stall_timeout_s if HEARTBEAT_HEADER in response.headers else None
                if not stream:
                    if not (watched and stall_s):
                        return Opened(response, body=await response.aread(), endpoints=[target],
                                      answered_at=answered_at)
                    async with asyncio.timeout(max(0.1, deadline - time.monotonic())):  # beats never end a wait
                        parts = [chunk async for chunk in _watched(response.aiter_bytes(), stall_s)]
                    return Opened(response, body=b"".join(parts), endpoints=[target], answered_at=answered_at)
                head = await self._read_head(response, deadline, stall_s)
                handed_over = True
                return Opened(response, head=head, endpoints=[target], stall_s=stall_s, answered_at=answered_at,
                              span=span)
            except UpstreamBroke as exc:  # a paced answer went silent: the member stopped (unless the router was late)
                if exc.reason == "stall":
                    HealthMonitor.eject(target, str(exc))
                raise UpstreamFailed(f"{url}: {exc}") from None
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                raise UpstreamFailed(f"{url} broke before its first event: {exc.__class__.__name__}") from None
            finally:
                if not handed_over:
                    await response.aclose()
        except BaseException as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)[:200] or type(exc).__name__))
            raise
        finally:
            if not handed_over:
                target.inflight -= 1
                span.end()

    async def _read_head(self, response: httpx.Response, deadline: float, stall_s: float | None) -> list[str]:
        """Lines up to and including the first data event, so a failure here is still retryable; a member that
        beats may go silent no longer than `stall_s`."""
        lines: list[str] = []
        iterator = sse_lines(response)
        response.extensions["tideflow_lines"] = iterator
        while True:
            wait = max(0.1, deadline - time.monotonic())
            wait = min(stall_s, wait) if stall_s else wait
            try:
                line = await asyncio.wait_for(iterator.__anext__(), timeout=wait)
            except StopAsyncIteration:
                raise UpstreamFailed("the upstream stream ended before its first event") from None
            except TimeoutError:
                raise UpstreamFailed(f"{response.url} sent nothing for {wait:g}s before its first event") from None
            lines.append(line)
            if line.startswith("data:"):
                if '"error"' in line[:20]:
                    raise UpstreamFailed(f"upstream error before the first token: {line[5:].strip()[:300]}")
                return lines

    async def _relay(self, group: GroupState, opened: Opened, api: str, upstream: dict, record: StreamRecord,
                     deadline: float) -> AsyncIterator[str]:
        """The client's events (JSON text), across as many upstreams as migration needs; raises StreamLost
        when the answer cannot be completed. Owns `group`'s and the endpoints' in-flight counts."""
        status, migrations = "error", 0
        current: Opened | None = opened
        holding = True  # this request counts in `group.inflight`
        broke: tuple[GroupState, float] | None = None  # the group a stream left and when, until its first new event
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                while True:
                    try:
                        lines = _lines(current) if current.stall_s is None else _watched(_lines(current), current.stall_s)
                        async for line in lines:
                            event = record.take(line)
                            if event is not None:
                                if broke is not None:
                                    left, at = broke
                                    self.metrics.migration_s.labels(left.reg.name, left.reg.version,
                                                                    "first_token").observe(time.monotonic() - at)
                                    broke = None
                                yield event
                        if not record.done:
                            raise UpstreamBroke("truncated", "the upstream stream ended before the request finished")
                        status = "ok"
                        return
                    except (httpx.HTTPError, UpstreamBroke) as exc:
                        reason = (exc.reason if isinstance(exc, UpstreamBroke)
                                  else "stall" if isinstance(exc, httpx.TimeoutException) else "disconnect")
                        why = str(exc) if isinstance(exc, UpstreamBroke) else f"upstream failed mid-stream: {exc.__class__.__name__}"
                    if reason == "stall":  # new requests must not find it while the health checks still pass
                        for endpoint in current.endpoints:
                            HealthMonitor.eject(endpoint, why)
                    current.span.set_status(trace.Status(trace.StatusCode.ERROR, why[:200]))
                    record.broken = current.span.get_span_context()  # the resumed stream links to it
                    await self._close(current)
                    current = None
                    if record.finish_reason is not None:  # every token is in; only the stream's tail was lost
                        status = "ok"
                        return
                    if migrations >= self.config.migration_limit or not record.resumable:
                        raise StreamLost("error", why)
                    migrations += 1
                    trace.get_current_span().set_attribute("tideflow.migrations", migrations)
                    self.metrics.migrations(group, reason).inc()
                    group.inflight -= 1
                    holding = False
                    broke = (group, time.monotonic())
                    try:
                        group, current = await self._open_any(api, upstream, record, deadline, {group.reg.name})
                    except (UpstreamFailed, UpstreamRejected, APIError) as exc:  # APIError: the router is busy
                        raise StreamLost("error", f"{why}; migrating it failed: {exc}") from None
                    holding = True
                    left, at = broke
                    self.metrics.migration_s.labels(left.reg.name, left.reg.version, "reopened").observe(
                        current.answered_at - at)
        except TimeoutError:
            status = "timeout"
            raise StreamLost("timeout", "request deadline passed") from None
        finally:
            if current is not None:
                await self._close(current)
            if holding:
                group.inflight -= 1
            self.metrics.observe(group, status, record)

    async def _send_unless_ejected(self, target: EndpointState, request: httpx.Request) -> httpx.Response:
        """The upstream's response head, unless the health monitor ejects the endpoint first: a member that
        stopped before it sent its head (a decode member pulling KV, an engine hung on admission) sends no
        heartbeat yet, and would otherwise be waited for until first_token_timeout_s."""
        send = asyncio.ensure_future(self.client.send(request, stream=True))
        ejected = asyncio.ensure_future(target.ejection())
        try:
            await asyncio.wait({send, ejected}, return_when=asyncio.FIRST_COMPLETED)
            if send.done():
                return send.result()
        except BaseException:  # this request was cancelled (its client left, its deadline passed): so is its send
            await _abandon(send)
            raise
        finally:
            ejected.cancel()
        await _abandon(send)
        raise UpstreamFailed(f"{request.url} was ejected by the health checks before it answered")

    @staticmethod
    async def _close(opened: Opened) -> None:
        opened.span.end()
        await opened.response.aclose()
        for e in opened.endpoints:
            e.inflight -= 1


async def _lines(opened: Opened) -> AsyncIterator[str]:
    """The buffered head, then the rest of the upstream's lines."""
    for line in opened.head:
        yield line
    async for line in opened.response.extensions["tideflow_lines"]:
        yield line


async def _watched(items: AsyncIterator, stall_s: float) -> AsyncIterator:
    """`items` (an upstream's lines or body chunks), or UpstreamBroke("stall") once none came for `stall_s`. Only
    the wait for the upstream counts: the timer is off while the caller handles an item (a slow client is not a
    stalled member)."""
    loop = asyncio.get_running_loop()
    upstream = items.__aiter__()
    due = loop.time()
    try:
        async with asyncio.timeout(None) as silence:
            while True:
                due = loop.time() + stall_s
                silence.reschedule(due)
                try:
                    item = await upstream.__anext__()
                except StopAsyncIteration:
                    return
                silence.reschedule(None)
                yield item
    except TimeoutError:
        late = loop.time() - due
        if late > ROUTER_LATE_S:  # the router's own loop was held up (a collection, a starved CPU): the bytes may
            raise UpstreamBroke("router_late", f"the router's event loop ran {late:.1f}s late") from None  # be there
        raise UpstreamBroke("stall", f"the upstream sent nothing for {stall_s:g}s (no event, no heartbeat)") from None


async def _sse(events: AsyncIterator[str], record: StreamRecord) -> AsyncIterator[str]:
    """Server-sent events for a streaming client; a lost answer ends with an error event."""
    try:
        async for event in events:
            yield f"data: {event}\n\n"
        for event in record.tail():
            yield f"data: {event}\n\n"
    except StreamLost as exc:
        yield f'data: {json.dumps({"error": {"message": str(exc), "type": "server_error", "code": exc.status}})}\n\n'
    yield "data: [DONE]\n\n"


class _ReleasingStream(StreamingResponse):
    """A streaming answer that runs `release` once it is over however it ended: a client gone before the first
    byte never starts the body's generator, whose own `finally` would then never run."""

    def __init__(self, inner: StreamingResponse, release) -> None:
        super().__init__(inner.body_iterator, status_code=inner.status_code, media_type=inner.media_type)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _once(fn):
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            fn()
    return run


def _json(content: dict) -> bytes:
    return json.dumps(content).encode()


def _block_hashes(tokens: list[int], block_size: int, extras: dict[int, bytes] | None = None) -> list[int]:
    hashes, prev = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        prev = block_hash(prev, tokens[i : i + block_size], (extras or {}).get(i // block_size, b""))
        hashes.append(prev)
    return hashes


def salted(extras: dict[int, bytes], body: dict) -> dict[int, bytes]:
    """A request's cache_salt folded into its first block's name, as the engine does (engine.core.llm_engine)."""
    salt = body.get("cache_salt")
    if not isinstance(salt, str) or not salt:
        return extras
    return {**extras, 0: b"salt:" + salt.encode() + extras.get(0, b"")}


def _fail(why: str):
    raise UpstreamFailed(why)


async def _abandon(send: asyncio.Future) -> None:
    """Cancel an upstream send and close the response it got if it answered anyway. asyncio.wait, not await: a
    cancellation of the caller's own task goes through, it is not taken for the send's."""
    send.cancel()
    await asyncio.wait({send})
    if not send.cancelled() and send.exception() is None:
        await send.result().aclose()
