"""Client of the router's admin API (the group manager and the canary use it)."""

from __future__ import annotations

import time

import httpx

from engine.runtime.errors import TideflowError
from engine.runtime.http import bearer_client
from engine.router.registry import Endpoint, GroupRegistration


class RouterAdminError(TideflowError):
    """The router refused or did not answer an admin call."""


class RouterAdmin:
    def __init__(self, url: str, admin_key: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._client = bearer_client(admin_key, self.url, timeout_s)

    def _call(self, method: str, path: str, **kw) -> dict:
        try:
            r = self._client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise RouterAdminError(f"router {self.url} did not answer {method} {path}: {exc}") from None
        if r.status_code >= 400:
            raise RouterAdminError(f"router {self.url} refused {method} {path}: {r.status_code} {r.text[:200]}")
        return r.json()

    def register(self, name: str, version: str, endpoints: list[Endpoint], weight: float = 1.0) -> None:
        reg = GroupRegistration(name=name, version=version, endpoints=endpoints, weight=weight)
        self._call("POST", "/admin/groups", json=reg.model_dump())

    def deregister(self, name: str) -> None:
        try:
            self._call("DELETE", f"/admin/groups/{name}")
        except RouterAdminError as exc:
            if " 404 " not in str(exc):
                raise

    def set_weights(self, weights: dict[str, float]) -> dict[str, float]:
        return self._call("PUT", "/admin/weights", json={"weights": weights})["weights"]

    def groups(self) -> list[dict]:
        return self._call("GET", "/admin/groups")["groups"]

    def inflight(self, name: str) -> int:
        return next((g["inflight"] for g in self.groups() if g["name"] == name), 0)

    def close(self) -> None:
        self._client.close()


def wait_drained(router, name: str, deadline: float, poll_s: float = 0.02) -> int:
    """Until monotonic `deadline`, wait for `router` (anything with `inflight(name)`: RouterAdmin, the controller's
    client) to hold no open request of group `name`; returns the count still open (0: drained)."""
    while (open_now := router.inflight(name)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return open_now


def scrape_members(client: httpx.Client, router_groups: list[dict]) -> list[str]:
    """/metrics of every endpoint in `router_groups` (RouterAdmin.groups()), with `client`'s member key;
    a member being rebuilt is skipped (its counts are missing from this scrape only)."""
    texts = []
    for group in router_groups:
        for e in group["endpoints"]:
            try:
                r = client.get(e["url"] + "/metrics")
                r.raise_for_status()
                texts.append(r.text)
            except httpx.HTTPError:
                continue
    return texts
