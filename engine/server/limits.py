"""A bound on request bodies, enforced before any handler reads them (an ASGI middleware).

A declared Content-Length over the limit is refused at once; a chunked body is counted as it
arrives and refused as soon as it passes the limit, so an oversized prompt costs no parsing or
tokenization. Answers 413 in the OpenAI error shape.
"""

from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 8 << 20  # room for a few base64 images in a chat request
# A member keeps idle connections open this long: longer than the router's keep-alive expiry (2 s), so the
# router never sends a request on a socket the member is closing.
MEMBER_KEEP_ALIVE_S = 30


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)  # the server stops at Content-Length: bounded already
            return
        # chunked: read it all here, counting, then hand it over in one piece
        chunks, seen = [], 0
        while True:
            message = await receive()
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
        body = json.dumps({"error": {"message": f"request body over {self.max_bytes} bytes",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
