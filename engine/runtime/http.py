"""The one HTTP client helper: a bearer key (or where to read the current one, for a key that rotates), a timeout,
no proxy from the environment (loopback traffic must never leave through an HTTP_PROXY), and the fleet's TLS
(`engine.runtime.tls`: the fleet CA trusted, this process's certificate shown to members that ask for it)."""

from __future__ import annotations

import ssl
from typing import AsyncIterator, Callable

import httpx

from engine.runtime import tls

Key = str | Callable[[], str] | None  # a key, or where to read the current one (a key that rotates)


class _CurrentKey(httpx.Auth):
    """Each request carries the key `current()` gives as it is sent: a long-lived client follows a rotation."""

    def __init__(self, current: Callable[[], str]) -> None:
        self.current = current

    def auth_flow(self, request: httpx.Request):
        request.headers["authorization"] = f"Bearer {self.current()}"
        yield request


def _headers(key: Key) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}


def _auth(key: Key) -> httpx.Auth | None:
    return _CurrentKey(key) if callable(key) else None


def _verify() -> ssl.SSLContext | bool:
    return tls.client_context() or True


def bearer_client(key: Key, base_url: str = "", timeout_s: float = 5.0) -> httpx.Client:
    return httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(key), auth=_auth(key), timeout=timeout_s,
                        trust_env=False, verify=_verify())


def bearer_async_client(key: Key, base_url: str = "", timeout_s: float = 5.0,
                        limits: httpx.Limits | None = None) -> httpx.AsyncClient:
    """The same, for the asyncio services (the router) and load generators."""
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(key), auth=_auth(key), timeout=timeout_s,
                             trust_env=False, limits=limits or httpx.Limits(), verify=_verify())


# What OpenSSL and h11 say when the two ends of a hop disagree about TLS, and what an operator should do about it
_TLS_HINTS = (
    ("certificate has expired", "the server's certificate has expired: the controller issues a new one with a "
                                "third of its life left, so is the controller running?"),
    ("CERTIFICATE_VERIFY_FAILED", "the server's certificate does not chain to a CA this process trusts (the fleet "
                                  "CA is $TIDEFLOW_HOME/tls/ca.pem; an operator's router certificate must chain to "
                                  "the system's CAs)"),
    ("UNKNOWN_CA", "the server refused this process's certificate: it is not from the server's CA"),
    ("CERTIFICATE_REQUIRED", "the server asks for a client certificate (mutual TLS) and this process showed none"),
    ("WRONG_VERSION_NUMBER", "the server speaks plain HTTP: use http://"),
    ("RECORD_LAYER_FAILURE", "the server speaks plain HTTP: use http://"),
)


def explain(exc: httpx.HTTPError, url: str) -> str:
    """`exc` as an operator can act on it: a TLS mismatch between this client and the server is named."""
    text = str(exc) or type(exc).__name__
    for needle, hint in _TLS_HINTS:
        if needle.lower() in text.lower():
            return f"{text} ({hint})"
    if isinstance(exc, httpx.RemoteProtocolError) and "without sending" in text:
        if url.startswith("http://"):
            return f"{text} (a server that speaks TLS closes a plain-HTTP connection like this: try https://)"
        # TLS 1.3 checks a client's certificate after the client's side of the handshake: the refusal reaches
        # the client as a closed connection
        return (f"{text} (a server that asks for a client certificate from its CA, mutual TLS, closes the "
                "connection like this when shown none or another CA's)")
    return text


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, split where SSE splits them (CR, LF or CRLF) and nowhere else.

    httpx's `aiter_lines` splits like `str.splitlines`, also at U+2028, U+0085, U+001C and the like. JSON leaves
    those characters raw (pydantic writes UTF-8), so a token that decodes to one of them would cut an event
    in two. Splitting the bytes is safe: CR and LF never occur inside a multi-byte UTF-8 sequence."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        held_cr = pending.endswith(b"\r")  # may be the first half of a CRLF: decided with the next chunk
        lines = (pending[:-1] if held_cr else pending).replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        pending = lines.pop() + (b"\r" if held_cr else b"")
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending.rstrip(b"\r"):
        yield pending.rstrip(b"\r").decode("utf-8", errors="replace")
