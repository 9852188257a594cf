"""Bounds on request bodies, enforced before any handler reads them (an ASGI middleware).

A declared Content-Length over the limit is refused at once; a chunked body is counted as it
arrives and refused as soon as it passes the limit, so an oversized prompt costs no parsing or
tokenization. Answers 413 in the OpenAI error shape. A body whose next bytes do not come within
`read_timeout_s` is answered 408 (a client trickling a body would hold its handler for ever).
"""

from __future__ import annotations

import asyncio
import json

from starlette.exceptions import HTTPException

DEFAULT_MAX_BODY_BYTES = 8 << 20  # room for a few base64 images in a chat request
# A member keeps idle connections open this long: longer than the router's keep-alive expiry (2 s), so the
# router never sends a request on a socket the member is closing.
MEMBER_KEEP_ALIVE_S = 30


DEFAULT_BODY_TIMEOUT_S = 30.0


class BodyReadTimeout(HTTPException):
    """A request body stalled: answered 408 (engine.api.errors). An HTTPException, so that FastAPI passes it on
    from reading a route's body parameter instead of answering 400 "There was an error parsing the body"."""

    def __init__(self, detail: str) -> None:
        super().__init__(408, detail)


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                await self._refuse(send)
                return
            body_done = False

            async def timed():  # the server stops at Content-Length: bounded already, but not in time
                nonlocal body_done
                if body_done:
                    return await receive()  # after the body: waiting for a disconnect may last the whole answer
                try:
                    message = await asyncio.wait_for(receive(), self.read_timeout_s)
                except asyncio.TimeoutError:
                    raise BodyReadTimeout(f"the request body stalled for {self.read_timeout_s:g}s") from None
                body_done = message["type"] != "http.request" or not message.get("more_body", False)
                return message

            await self.app(scope, timed, send)
            return
        # chunked: read it all here, counting, then hand it over in one piece
        chunks, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                await self._answer(send, 408, f"the request body stalled for {self.read_timeout_s:g}s",
                                   "request_timeout")
                return
            if message["type"] != "http.request":
                return  # the client went away
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        await self._answer(send, 413, f"request body over {self.max_bytes} bytes", "request_too_large")

    async def _answer(self, send, status: int, message: str, code: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
