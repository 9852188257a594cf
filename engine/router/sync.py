"""A router that takes its groups from the controller: a long-poll watch of the route set, and a report
of its own in-flight counts.

Why pull, not push: every router replica (a restarted one, a second one behind a load balancer, a
pod of the router Deployment) serves exactly the controller's route set without the controller
having to know it exists, and a controller restart never empties a router: the router keeps its
last route set until the controller answers again. The report is what lets the controller drain a
group (weight 0, then wait for in-flight requests to end) across every replica; it carries counts
only, so the controller never sends a key to a replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable

import httpx
from pydantic import BaseModel, Field

from engine.runtime.http import bearer_async_client
from engine.router.registry import GroupRegistration, Registry

log = logging.getLogger(__name__)

ROUTES_KEY_ENV = "TIDEFLOW_ROUTES_KEY"
WATCH_S = 20.0  # how long one watch request waits for a change before the controller answers "same"


class RouteSet(BaseModel):
    """Every group the controller routes to now; `revision` grows with each change."""

    revision: int = Field(ge=0)
    groups: list[GroupRegistration] = Field(default_factory=list, max_length=4096)


class GroupLoad(BaseModel):
    inflight: int = Field(ge=0, description="requests this replica has in flight to the group")
    routable: bool = Field(description="every endpoint healthy and weight > 0, as this replica sees it")


class RouterReport(BaseModel):
    """What one router replica tells the controller every `report_s`."""

    replica: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@-]+$",
                         description="id of the replica (host:port/pid/random), for status and freshness")
    revision: int = Field(ge=0, description="the route set revision this replica serves")
    url: str | None = Field(None, max_length=300, pattern=r"^https?://[^/\s]+$",
                            description="where this replica alone answers (its metrics and samples), if it has such")
    key_state: str = Field("", max_length=64, description="digest of the keys it accepts and sends now "
                                                          "(engine.api.auth.key_state): a rotation reached it "
                                                          "once this is the controller's")
    groups: dict[str, GroupLoad] = Field(default_factory=dict, max_length=4096)


class ControllerSync:
    """Two asyncio tasks inside the router: `watch` applies each new route set, `report` sends load."""

    def __init__(self, registry: Registry, controller_url: str, key: Callable[[], str], replica: str,
                 report_s: float = 0.25, accept: Callable[[GroupRegistration], str | None] = lambda reg: None,
                 url: str | None = None, key_state: Callable[[], str] = lambda: "") -> None:
        """`key`: the routes key as its file holds it now (a rotation is followed); `url`: where this replica alone
        answers, reported with its load (None: nowhere but the shared port)."""
        self.registry, self.url, self.key, self.report_s, self.accept = registry, controller_url, key, report_s, accept
        self.own_url, self.key_state = url, key_state
        self.replica = f"{replica}/{os.getpid()}/{secrets.token_hex(3)}"
        self.revision = 0
        self.synced = asyncio.Event()  # set once the first route set is applied
        self._tasks: list[asyncio.Task] = []
        self._client: httpx.AsyncClient | None = None

    def start(self) -> None:
        self._client = bearer_async_client(self.key(), self.url, timeout_s=WATCH_S + 10)
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._report())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def _watch(self) -> None:
        backoff = 0.2
        while True:
            try:
                self._client.headers["authorization"] = f"Bearer {self.key()}"
                r = await self._client.get("/v1/routes", params={"after": self.revision, "wait_s": WATCH_S})
                r.raise_for_status()
                self.apply(RouteSet.model_validate_json(r.content))
                backoff = 0.2
            except (httpx.HTTPError, ValueError) as exc:
                # The controller is restarting (or refuses us): keep serving the last route set.
                if backoff == 0.2:
                    log.warning("router: controller %s did not give routes (%s); serving the last %d groups",
                                self.url, _short(exc), len(self.registry.groups()))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def apply(self, routes: RouteSet) -> None:
        if routes.revision < self.revision:  # a restarted controller counts from its own start again
            log.warning("router: controller revision went back (%d -> %d); taking its route set",
                        self.revision, routes.revision)
        kept = []
        for reg in routes.groups:
            refused = self.accept(reg)
            if refused:
                log.warning("router: group %s left out: %s", reg.name, refused)
            else:
                kept.append(reg)
        self.registry.replace(kept)
        self.revision = routes.revision
        self.synced.set()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.report_s)
            if not self.synced.is_set():
                continue
            self._client.headers["authorization"] = f"Bearer {self.key()}"
            report = RouterReport(replica=self.replica, revision=self.revision, url=self.own_url,
                                  key_state=self.key_state(), groups={
                g.reg.name: GroupLoad(inflight=g.inflight, routable=g.routable) for g in self.registry.groups()})
            try:
                await self._client.post("/v1/routes/report", content=report.model_dump_json(),
                                        headers={"content-type": "application/json"}, timeout=2.0)
            except httpx.HTTPError:
                continue  # the watch logs the controller's absence; a report is worth nothing late


def _short(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    return type(exc).__name__ + (f": {exc}" if str(exc) else "")

