"""The router's per-request samples for one canary step, read from a cursor per router replica so each check
fetches only what is new, from every replica.

Replicas sharing one port (SO_REUSEPORT) each keep their own samples: read through the shared port, a check
would see whichever replica the kernel picked, and a cursor of one replica's numbering could land on another.
So each replica is read where it alone answers (engine.control.models.FleetStatus.replica_urls). A replica
first seen after the step started (started again after a kill) is read from its first sample; one that no
longer answers has lost what it had not yet served (the requests it held failed with it), which is logged, not
an error, while another replica answers.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import httpx

from engine.canary.judge import Samples
from engine.runtime.errors import TideflowError
from engine.runtime.http import bearer_client
from engine.router.samples import Sample, SamplePage

log = logging.getLogger(__name__)

PAGE = 20_000


class SamplesUnavailable(TideflowError):
    """No router replica served its samples (down, wrong key), or one dropped samples the step needs."""


class _Unreachable(Exception):
    """One replica did not answer (it may have died): the others may still."""


class RouterSamples:
    """Samples of the named groups since `start()`: the step's evidence, kept per group."""

    def __init__(self, router_urls: str | Callable[[], list[str]], key: str, groups: list[str],
                 timeout_s: float = 10.0) -> None:
        """`router_urls`: one router's URL, or what gives the live replicas' own URLs at each read."""
        self._urls = (lambda: [router_urls]) if isinstance(router_urls, str) else router_urls
        self.groups = list(groups)
        self._client = bearer_client(key, timeout_s=timeout_s)
        self._cursors: dict[str, int] = {}
        self.by_group: dict[str, list[Sample]] = defaultdict(list)

    def _page(self, url: str, after: int, limit: int) -> SamplePage:
        try:
            r = self._client.get(url.rstrip("/") + "/samples", params={"after": after, "group": self.groups,
                                                                       "limit": limit})
        except httpx.HTTPError as exc:
            raise _Unreachable(f"router {url} did not serve /samples: {exc}") from None
        if r.status_code != 200:
            raise SamplesUnavailable(f"router {url} refused /samples: {r.status_code} {r.text[:200]}")
        return SamplePage.model_validate_json(r.content)

    def _replicas(self) -> list[str]:
        urls = self._urls()
        if not urls:
            raise SamplesUnavailable("no router replica is serving")
        return urls

    def start(self) -> None:
        """From now on: later fetches return only requests that finish after this."""
        self._cursors, failures = {}, []
        for url in self._replicas():
            try:
                self._cursors[url] = self._page(url, 0, 0).next
            except _Unreachable as exc:
                failures.append(str(exc))
        if not self._cursors:
            raise SamplesUnavailable("; ".join(failures))
        self.by_group.clear()

    def fetch(self) -> None:
        """Everything new since the last fetch, from every replica; a replica that dropped some of it (a tiny
        buffer, or a step so long its samples rolled out) is an error, not a silently thinner sample."""
        urls, failures = self._replicas(), []
        for url in urls:
            try:
                self._fetch(url)
            except _Unreachable as exc:
                failures.append(str(exc))
        if len(failures) == len(urls):
            raise SamplesUnavailable("; ".join(failures))
        for failure in failures:
            log.warning("canary samples: %s (a replica gone: its unread samples are lost)", failure)
        for gone in set(self._cursors) - set(urls):
            del self._cursors[gone]

    def _fetch(self, url: str) -> None:
        cursor = self._cursors.get(url, 0)  # a replica new since start(): from its first sample
        while True:
            page = self._page(url, cursor, PAGE)
            if page.dropped:
                raise SamplesUnavailable(f"router {url} dropped {page.dropped} samples of this step before "
                                         "they were read; check more often or raise its buffer")
            for s in page.samples:
                self.by_group[s.group].append(s)
            cursor = self._cursors[url] = page.next
            if len(page.samples) < PAGE:
                return

    def of(self, group: str) -> Samples:
        return Samples.of(self.by_group.get(group, []))

    def close(self) -> None:
        self._client.close()
