"""The one HTTP client helper: a bearer key, a timeout, no proxy from the environment (loopback traffic
must never leave through an HTTP_PROXY)."""

from __future__ import annotations

import httpx


def _headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def bearer_client(key: str | None, base_url: str = "", timeout_s: float = 5.0) -> httpx.Client:
    return httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(key), timeout=timeout_s, trust_env=False)


def bearer_async_client(key: str | None, base_url: str = "", timeout_s: float = 5.0,
                        limits: httpx.Limits | None = None) -> httpx.AsyncClient:
    """The same, for the asyncio services (the router) and load generators."""
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(key), timeout=timeout_s, trust_env=False,
                             limits=limits or httpx.Limits())
