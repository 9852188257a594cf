"""Bearer API keys: loaded from env or a file, checked in constant time, never logged.

A key file is read again when it changes (checked at most every RECHECK_S), so a key rotated by the controller
(`tideflow keys rotate`) takes effect in a running server without a restart. An entry may be a key's SHA-256
(`sha256:<hex>`) where the server only verifies it, and may carry `until=<unix time>`: the end of an old key's
grace after a rotation, from which it is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fastapi import Request
from pydantic import BaseModel, Field

from engine.core.sampling_params import PRIORITY_RANGE
from engine.api.errors import APIError
from tideflow_kernels.atomic_file import atomic_write_text

API_KEYS_ENV = "TIDEFLOW_API_KEYS"
API_KEY_FILE_ENV = "TIDEFLOW_API_KEY_FILE"  # a key file read again when it changes (the controller's routers)
# Who a forwarded request is for: the router names the client it came from (a digest of its key, never the key).
# A member takes it only from a caller whose key forwards (ApiKey.forwards: in a fleet, the router's key to its
# members); a client naming another client gets served as itself.
CLIENT_HEADER = "x-tideflow-client"
MAX_CLIENT_CHARS = 64
DIGEST_PREFIX = "sha256:"
RECHECK_S = 0.5


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
    until: float | None = Field(None, description="unix time from which the key is refused (an old key's grace)")

    @classmethod
    def parse(cls, entry: str) -> "ApiKey":
        """`KEY [priority>=N] [forwards] [until=T]` (a line of a key file, an entry of $TIDEFLOW_API_KEYS); KEY
        may be `sha256:<hex>`, the key's digest."""
        key, *options = entry.split()
        fields: dict = {"key": key}
        if key.startswith(DIGEST_PREFIX) and len(key) != len(DIGEST_PREFIX) + 64:
            raise ValueError("a sha256: key entry needs the 64 hex digits of the key's SHA-256")
        for option in options:
            name, sep, value = option.partition(">=")
            until, eq, when = option.partition("=")
            if option == "forwards":
                fields["forwards"] = True
            elif name == "priority" and sep and value.lstrip("-").isdigit():
                fields["priority_floor"] = int(value)
            elif until == "until" and eq and when.replace(".", "", 1).isdigit():
                fields["until"] = float(when)
            else:
                raise ValueError(f"API key option {option[:40]!r}: the options are priority>=N (an integer), "
                                 "forwards and until=T (unix time)")
        return cls(**fields)

    def entry(self) -> str:
        """The key file line of this key (its inverse of `parse`)."""
        return " ".join([self.key, *([f"priority>={self.priority_floor}"] if self.priority_floor else []),
                         *(["forwards"] if self.forwards else []), *([f"until={self.until:.0f}"] if self.until else [])])

    def hashed(self) -> "ApiKey":
        """The same key as its digest: what a file needs where the key is only verified."""
        if self.key.startswith(DIGEST_PREFIX):
            return self
        return self.model_copy(update={"key": DIGEST_PREFIX + hashlib.sha256(self.key.encode()).hexdigest()})

    def matches(self, token: bytes, token_digest: str, now: float) -> bool:
        """Constant time in the key's length; an expired key never matches."""
        if self.key.startswith(DIGEST_PREFIX):
            same = hmac.compare_digest(token_digest, self.key[len(DIGEST_PREFIX):])
        else:
            same = hmac.compare_digest(token, self.key.encode())
        return same and (self.until is None or now < self.until)


def key_source(key_file: str | Path | None = None, environ: dict[str, str] | None = None) -> KeySource:
    """Keys from $TIDEFLOW_API_KEYS (fixed) and the key file (read again when it changes); checked now, so a bad
    entry refuses the start."""
    env = os.environ if environ is None else environ
    fixed = [ApiKey.parse(k.strip()) for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    key_file = key_file if key_file is not None else env.get(API_KEY_FILE_ENV) or None
    path = Path(key_file) if key_file is not None else None
    if path is not None:
        _distinct([*fixed, *parse_key_lines(path.read_text())])
    return KeySource(_distinct(fixed), path)


def _distinct(keys: list[ApiKey]) -> list[ApiKey]:
    seen: set[str] = set()
    for i, k in enumerate(keys):
        if k.key in seen:  # two entries of one key would grant whichever came last, silently
            raise ValueError(f"API key entry {i + 1} repeats an earlier key (the key itself is not shown); "
                             "keep one entry per key")
        seen.add(k.key)
    return keys


def parse_key_lines(text: str) -> list[ApiKey]:
    return [ApiKey.parse(ln.strip()) for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def write_key_file(path: Path, keys: Sequence[ApiKey]) -> None:
    """Replace `path` at once (0600): a reader sees the old file or the new one, never a part."""
    atomic_write_text(path, "".join(k.entry() + "\n" for k in keys), mode=0o600)


class KeySource:
    """The keys a server accepts now: fixed ones ($TIDEFLOW_API_KEYS, arguments), those a callable gives (the
    controller's own, with an old one's grace), and those of a key file, read again when it changes. A server
    with a key file or a callable is closed even when they give no key: an emptied file locks out, never opens."""

    def __init__(self, fixed: Sequence[str | ApiKey] = (), path: Path | None = None,
                 dynamic: Callable[[], list[ApiKey]] | None = None) -> None:
        self.fixed = [k if isinstance(k, ApiKey) else ApiKey(key=k) for k in fixed]
        self.path, self.dynamic = path, dynamic
        self._file: list[ApiKey] = []
        self._seen: tuple | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if path is not None:
            self._reload()

    @property
    def enabled(self) -> bool:
        return bool(self.fixed) or self.path is not None or self.dynamic is not None

    def keys(self) -> list[ApiKey]:
        if self.path is not None and time.monotonic() - self._checked >= RECHECK_S:
            self._reload()
        return [*self.fixed, *self._file, *(self.dynamic() if self.dynamic is not None else [])]

    def _reload(self) -> None:
        with self._lock:
            self._checked = time.monotonic()
            try:
                st = self.path.stat()
            except OSError:
                return  # gone for a moment (an editor's save): keep the keys read last
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return
            try:
                self._file = parse_key_lines(self.path.read_text())
            except (OSError, ValueError):
                return  # a file that does not parse keeps the keys read last (the start refused a bad one)
            self._seen = seen


class SecretFile:
    """One key this process sends, kept in a 0600 file the controller replaces when it rotates the key:
    `current()` reads it again when it changed (checked at most every RECHECK_S)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._value, self._seen, self._checked = "", None, 0.0
        self._lock = threading.Lock()
        self._reload()
        if not self._value:
            raise ValueError(f"key file {path} holds no key")

    def current(self) -> str:
        if time.monotonic() - self._checked >= RECHECK_S:
            self._reload()
        return self._value

    def _reload(self) -> None:
        with self._lock:
            self._checked = time.monotonic()
            try:
                st = self.path.stat()
                seen = (st.st_ino, st.st_mtime_ns, st.st_size)
                if seen != self._seen:
                    value = self.path.read_text().strip()
                    if value:
                        self._value, self._seen = value, seen
            except OSError:
                return  # gone for a moment: keep the key read last


def key_state(accepted: Sequence[ApiKey], *sent: str) -> str:
    """A digest of the keys a process accepts and sends now: a router reports it, and the controller, which wrote
    those keys, knows a rotation reached the router once the two agree (the keys themselves never travel)."""
    text = "\n".join(sorted(k.hashed().entry() for k in accepted)) + "\0" + "\0".join(
        hashlib.sha256(s.encode()).hexdigest() for s in sent)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def secret_from_env(name: str) -> Callable[[], str] | None:
    """The key in $NAME, or the one in the file $NAME_FILE names (read again when it changes); None if neither."""
    path = os.environ.get(name + "_FILE")
    if path:
        return SecretFile(Path(path)).current
    value = os.environ.get(name)
    return (lambda: value) if value else None


class BearerAuth:
    """FastAPI dependency; with no keys configured every request is let through."""

    def __init__(self, keys: Sequence[str | ApiKey] | KeySource) -> None:
        self.source = keys if isinstance(keys, KeySource) else KeySource(keys)

    @property
    def enabled(self) -> bool:
        return self.source.enabled

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
        return key_digest(bearer_token(request) or "")  # the caller's key, whether it is held clear or hashed

    def _match(self, request: Request) -> ApiKey | None:
        if not self.source.enabled:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = token.strip().encode()
        digest, now = hashlib.sha256(given).hexdigest(), time.time()
        matched = None
        for key in self.source.keys():  # every key compared, in constant time, whichever matches
            if key.matches(given, digest, now):
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
