"""The control API's calls as audit entries (engine.control.audit): an ASGI middleware around the API.

What is recorded: every call that changes something (any method but GET and HEAD), and every call refused
for its key (401 or 403), whatever its method. Not recorded: reads that succeed, the routers' load reports
(four a second a replica: telemetry, not control), and a flow's renewal of a fleet lease it already holds
(its taking and its release are recorded). The body is read as the API reads it, never twice, and the entry
is written off the event loop (it waits for the disk).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable
from urllib.parse import parse_qs

from engine.control.audit import AuditLog
from engine.api.auth import key_digest

NOT_AUDITED = {("POST", "/v1/routes/report")}
CAPTURE_BYTES = 1 << 20  # the API's own body limit: nothing larger reaches a handler


def result_of(status: int) -> str:
    """ok, refused (the key), rejected (the request) or failed (the controller; 0: no answer was sent)."""
    if status in (401, 403):
        return "refused"
    if 200 <= status < 400:
        return "ok"
    return "rejected" if 400 <= status < 500 else "failed"


def target_of(path: str, body: Any) -> str | None:
    """What a call acts on: the name in its path, else the one its body names."""
    parts = path.strip("/").split("/")
    if len(parts) >= 3 and parts[1] in ("groups", "autoscalers"):
        return parts[2]
    if not isinstance(body, dict):
        return None
    for field in ("name", "canary", "holder"):
        if isinstance(body.get(field), str):
            return body[field]
    template = body.get("template")
    if isinstance(template, dict) and isinstance(template.get("name"), str):
        return template["name"]
    if isinstance(body.get("weights"), dict):
        return ",".join(sorted(body["weights"]))
    return None


class AuditMiddleware:
    """ASGI middleware: `roles` maps a key's digest to its role name (admin, client, routes)."""

    def __init__(self, app, audit: AuditLog, roles: Callable[[], dict[str, str]]) -> None:
        self.app, self.audit, self.roles = app, audit, roles

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path, started = scope["method"], scope["path"], time.time()
        body, answer, status = bytearray(), bytearray(), 0

        async def receiving():
            message = await receive()
            if message["type"] == "http.request" and len(body) < CAPTURE_BYTES:
                body.extend(message.get("body", b"")[: CAPTURE_BYTES - len(body)])
            return message

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and len(answer) < 4096:
                answer.extend(message.get("body", b"")[: 4096 - len(answer)])
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        finally:
            if self._audited(method, path, status, bytes(answer), started):
                await asyncio.to_thread(self._record, scope, method, path, bytes(body), status)

    @staticmethod
    def _audited(method: str, path: str, status: int, answer: bytes, started: float) -> bool:
        if status in (401, 403):
            return True
        if method in ("GET", "HEAD", "OPTIONS") or (method, path) in NOT_AUDITED:
            return False
        if (method, path) == ("PUT", "/v1/lease") and status == 200:
            try:  # a renewal: the lease was first granted before this call
                return float(json.loads(answer)["acquired_at"]) >= started - 1.0
            except (ValueError, KeyError, TypeError):
                return True
        return True

    def _record(self, scope, method: str, path: str, raw: bytes, status: int) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        actor = "anonymous"
        if token:
            digest = key_digest(token)
            actor = f"{self.roles().get(digest, 'unknown')}:{digest}"
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = {"unparsed_bytes": len(raw)}
        query = {k: v[0] if len(v) == 1 else v for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        params = {**({"query": query} if query else {}), **({"body": body} if body is not None else {})}
        target = target_of(path, body) or (query.get("holder") if isinstance(query.get("holder"), str) else None)
        self.audit.record(actor, f"{method} {path}", target, params, result_of(status), status)
