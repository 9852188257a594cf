"""The one HTTP client helper: a bearer key (or where to read the current one, for a key that rotates), a timeout,
no proxy from the environment (loopback traffic must never leave through an HTTP_PROXY)."""

from __future__ import annotations

from typing import AsyncIterator, Callable

import httpx

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


def bearer_client(key: Key, base_url: str = "", timeout_s: float = 5.0) -> httpx.Client:
    return httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(key), auth=_auth(key), timeout=timeout_s,
                        trust_env=False)


def bearer_async_client(key: Key, base_url: str = "", timeout_s: float = 5.0,
                        limits: httpx.Limits | None = None) -> httpx.AsyncClient:
    """The same, for the asyncio services (the router) and load generators."""
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(key), auth=_auth(key), timeout=timeout_s,
                             trust_env=False, limits=limits or httpx.Limits())


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
