"""Active health checks: probe every endpoint's /ready, eject after N failures, re-admit after M passes.

The same loop refreshes each endpoint's load figures from /internal/stats for the balancers.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from engine.router.kv_index import KVIndex
from engine.runtime.http import explain
from engine.router.registry import EndpointState, Registry

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, interval_s: float, eject_after: int,
                 readmit_after: int, kv_index: KVIndex | None = None) -> None:
        """With `kv_index`, each probe of a colocated or prefill member also reads its KV event feed into it."""
        self.registry, self.client, self.kv_index = registry, client, kv_index
        self.interval_s, self.eject_after, self.readmit_after = interval_s, eject_after, readmit_after
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            endpoints = [e for g in self.registry.groups() for e in g.endpoints]
            await asyncio.gather(*(self.probe(e) for e in endpoints))
            await asyncio.sleep(self.interval_s)

    async def probe(self, e: EndpointState) -> None:
        try:
            ready = await self.client.get(e.endpoint.url + "/ready", timeout=self.interval_s * 4)
            ok, why = ready.status_code == 200, f"/ready answered {ready.status_code}"
            if ok:
                stats = await self.client.get(e.endpoint.url + "/internal/stats", timeout=self.interval_s * 4)
                if stats.status_code == 200:
                    e.stats = stats.json()
                if self.kv_index is not None and e.endpoint.role in ("colocated", "prefill", "decode"):
                    await self.read_kv_events(e)
        except httpx.HTTPError as exc:
            ok, why = False, explain(exc, e.endpoint.url)  # a TLS mismatch is named in the ejection's log line
        except ValueError as exc:
            ok, why = False, f"unreadable stats: {exc}"
        self.observe(e, ok, why if not ok else "")

    async def read_kv_events(self, e: EndpointState) -> None:
        """Pages of the member's feed until it has no more (a few at most per probe); a member without a feed is
        routed without one."""
        url = e.endpoint.url
        for _ in range(8):
            epoch, after = self.kv_index.cursor(url)
            got = await self.client.get(url + "/internal/kv-events", params={"epoch": epoch, "after": after},
                                        timeout=self.interval_s * 4)
            if got.status_code == 404:
                self.kv_index.silent(url)
                return
            if got.status_code != 200:
                return  # the feed goes stale, and the fallback takes over
            page = got.json()
            self.kv_index.apply(url, page)
            if page.get("reset") or not page.get("events"):
                return

    def observe(self, e: EndpointState, ok: bool, why: str = "") -> None:
        if ok:
            e.fails, e.passes = 0, e.passes + 1
            if not e.healthy and e.passes >= self.readmit_after:
                e.readmit()
                log.warning("router: re-admitted %s (%s)", e.endpoint.url, e.endpoint.role)
        else:
            e.passes, e.fails = 0, e.fails + 1
            if e.healthy and e.fails >= self.eject_after:
                self.eject(e, f"failed health checks: {why}" if why else "failed health checks")

    @staticmethod
    def eject(e: EndpointState, why: str) -> None:
        """Passive ejection too: a connection failure while forwarding takes the endpoint out at once."""
        if e.healthy:
            log.warning("router: ejected %s (%s): %s", e.endpoint.url, e.endpoint.role, why)
        e.eject()
        e.passes = 0
