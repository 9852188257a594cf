"""Flip every member of a group between serving and standby at once (the engines' /admin routes)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from engine.runtime.errors import TideflowError
from engine.runtime.http import Key, bearer_client


class MemberSwitchError(TideflowError):
    """A member refused or did not answer an activate or park call; the message names it and why."""


class MemberSwitch:
    """Calls POST /admin/activate or /admin/park on many members in parallel, with the members' API key."""

    def __init__(self, api_key: Key, timeout_s: float = 30.0) -> None:
        self._client = bearer_client(api_key, timeout_s=timeout_s)

    def activate(self, endpoints: list[str]) -> list[float]:
        """Seconds each member took to allocate its KV cache and start serving."""
        return self._all(endpoints, "/admin/activate", None)

    def park(self, endpoints: list[str], drain_s: float) -> list[float]:
        """Seconds each member took to drain its open requests and release its KV cache."""
        return self._all(endpoints, "/admin/park", {"drain_s": drain_s}, drain_s)

    def _all(self, endpoints: list[str], path: str, body: dict | None, extra_s: float = 0.0) -> list[float]:
        if not endpoints:
            raise MemberSwitchError(f"no member endpoints to call {path} on")
        with ThreadPoolExecutor(max_workers=min(32, len(endpoints))) as pool:
            return list(pool.map(lambda url: self._one(url, path, body, extra_s), endpoints))

    def _one(self, url: str, path: str, body: dict | None, extra_s: float) -> float:
        timeout = httpx.Timeout(self._client.timeout.read + extra_s, connect=self._client.timeout.connect)
        try:
            r = self._client.post(url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise MemberSwitchError(f"{url}{path} did not answer: {exc.__class__.__name__}: {exc}") from None
        if r.status_code != 200:
            raise MemberSwitchError(f"{url}{path} answered {r.status_code}: {r.text[:300]}")
        return float(r.json()["seconds"])

    def close(self) -> None:
        self._client.close()
