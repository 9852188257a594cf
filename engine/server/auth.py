"""Bearer API keys: loaded from env or a file, checked in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fastapi import Request

from engine.server.errors import APIError

API_KEYS_ENV = "TIDEFLOW_API_KEYS"
# Who a forwarded request is for: the router names the client it came from (a digest of its key, never the key).
# Members trust it from any caller holding one of their keys, which in a fleet are the fleet's own.
CLIENT_HEADER = "x-tideflow-client"
MAX_CLIENT_CHARS = 64


def key_digest(key: str) -> str:
    """A client's name that says which key it used without carrying the key (logs, headers, schedulers)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def client_id(request: Request) -> str:
    """Whom the engine serves with this request, as its fair scheduler counts: the router's word when it forwarded
    the request, else the caller's own key (digested); "" for a server without keys."""
    named = request.headers.get(CLIENT_HEADER)
    if named:
        return named[:MAX_CLIENT_CHARS]
    token = bearer_token(request)
    return key_digest(token) if token else ""


def load_api_keys(key_file: str | Path | None = None, environ: dict[str, str] | None = None) -> list[str]:
    """Keys from $TIDEFLOW_API_KEYS (comma-separated) and/or a file (one key per line, # comments)."""
    env = os.environ if environ is None else environ
    keys = [k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if key_file is not None:
        lines = Path(key_file).read_text().splitlines()
        keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return keys


class BearerAuth:
    """FastAPI dependency; with no keys configured every request is let through."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    async def __call__(self, request: Request) -> None:
        """Async on purpose: FastAPI runs a sync dependency in its thread pool, a thread hop on every request
        for a check that takes microseconds."""
        self.check(request)

    def check(self, request: Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = token.strip().encode()
        if not any(hmac.compare_digest(given, k) for k in self._keys):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")


def publish_openapi(app, auth: BearerAuth) -> None:
    """GET /openapi.json behind `auth` (the app is built with openapi_url=None): clients and fuzzers read
    the schema with a key, like every other route."""
    from fastapi import Depends

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(auth)])
    async def openapi() -> dict:
        return app.openapi()
