"""Bearer API keys: loaded from env or a file, checked in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from pathlib import Path

from fastapi import Request
from pydantic import BaseModel, Field

from engine.core.sampling import PRIORITY_RANGE
from engine.server.errors import APIError

API_KEYS_ENV = "TIDEFLOW_API_KEYS"
# Who a forwarded request is for: the router names the client it came from (a digest of its key, never the key).
# A member takes it only from a caller whose key forwards (ApiKey.forwards: in a fleet, the router's key to its
# members); a client naming another client gets served as itself.
CLIENT_HEADER = "x-tideflow-client"
MAX_CLIENT_CHARS = 64


def key_digest(key: str) -> str:
    """A client's name that says which key it used without carrying the key (logs, headers, schedulers)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class ApiKey(BaseModel):
    """A key and what its holder may ask for. A client key bounds how urgent its requests may be: they go before
    other clients' only as far as the operator allowed (lower runs first; 0 by default, so a plain key may only
    defer its own). A forwarding key is a router's: its requests name their client (CLIENT_HEADER) and had their
    priority bounded by that client's key where they came in."""

    key: str = Field(min_length=1, repr=False)  # a secret: never in a repr, a log line or an error
    priority_floor: int = Field(0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
                                description="requests of this key may ask for priority >= this")
    forwards: bool = Field(False, description="a router's key: trusted to name the client and its priority")

    @classmethod
    def parse(cls, entry: str) -> "ApiKey":
        """`KEY`, `KEY priority>=N` or `KEY forwards` (a line of a key file, an entry of $TIDEFLOW_API_KEYS)."""
        key, *options = entry.split()
        fields: dict = {"key": key}
        for option in options:
            name, sep, value = option.partition(">=")
            if option == "forwards":
                fields["forwards"] = True
            elif name == "priority" and sep and value.lstrip("-").isdigit():
                fields["priority_floor"] = int(value)
            else:
                raise ValueError(f"API key option {option[:40]!r}: the options are priority>=N (an integer) and "
                                 "forwards")
        return cls(**fields)


def load_api_keys(key_file: str | Path | None = None, environ: dict[str, str] | None = None) -> list[ApiKey]:
    """Keys from $TIDEFLOW_API_KEYS (comma-separated) and/or a file (one key per line, # comments), each
    optionally followed by `priority>=N`."""
    env = os.environ if environ is None else environ
    entries = [k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    if key_file is not None:
        lines = Path(key_file).read_text().splitlines()
        entries += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    keys = [ApiKey.parse(entry) for entry in entries]
    seen: set[str] = set()
    for i, k in enumerate(keys):
        if k.key in seen:  # two entries of one key would grant whichever came last, silently
            raise ValueError(f"API key entry {i + 1} repeats an earlier key (the key itself is not shown); "
                             "keep one entry per key")
        seen.add(k.key)
    return keys


class BearerAuth:
    """FastAPI dependency; with no keys configured every request is let through."""

    def __init__(self, keys: Sequence[str | ApiKey]) -> None:
        self._keys = [k if isinstance(k, ApiKey) else ApiKey(key=k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    async def __call__(self, request: Request) -> None:
        """Async on purpose: FastAPI runs a sync dependency in its thread pool, a thread hop on every request
        for a check that takes microseconds."""
        self._match(request)

    def check(self, request: Request) -> None:
        self._match(request)

    def priority_floor(self, request: Request) -> int | None:
        """The most urgent priority the caller may ask for; None (any) on a server without keys, and for a
        forwarding key (bounded where the request came in)."""
        key = self._match(request)
        return None if key is None or key.forwards else key.priority_floor

    def client_of(self, request: Request) -> str:
        """Whom the engine serves with this request, as its fair scheduler and its token cap count: the client a
        forwarding key names ("": one it cannot name, the router having no client keys), else the caller's own key
        (digested); "" for a server without keys."""
        key = self._match(request)
        if key is None:
            return ""
        if key.forwards:
            return request.headers.get(CLIENT_HEADER, "")[:MAX_CLIENT_CHARS]
        return key_digest(key.key)

    def _match(self, request: Request) -> ApiKey | None:
        if not self._keys:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = token.strip().encode()
        matched = None
        for key in self._keys:  # every key compared, in constant time, whichever matches
            if hmac.compare_digest(given, key.key.encode()):
                matched = key
        if matched is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return matched


def publish_openapi(app, auth: BearerAuth) -> None:
    """GET /openapi.json behind `auth` (the app is built with openapi_url=None): clients and fuzzers read
    the schema with a key, like every other route."""
    from fastapi import Depends

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(auth)])
    async def openapi() -> dict:
        return app.openapi()
