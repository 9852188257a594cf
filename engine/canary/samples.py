"""The router's per-request samples for one canary step, read from a cursor so each check fetches only what is new."""

from __future__ import annotations

from collections import defaultdict

import httpx

from engine.canary.judge import Samples
from engine.errors import TideflowError
from engine.http import bearer_client
from engine.router.samples import Sample, SamplePage

PAGE = 20_000


class SamplesUnavailable(TideflowError):
    """The router did not serve its samples (down, wrong key, or it dropped samples the step needs)."""


class RouterSamples:
    """Samples of the named groups since `start()`: the step's evidence, kept per group."""

    def __init__(self, router_url: str, key: str, groups: list[str], timeout_s: float = 10.0) -> None:
        self.url, self.groups = router_url.rstrip("/"), list(groups)
        self._client = bearer_client(key, self.url, timeout_s)
        self._cursor = 0
        self.by_group: dict[str, list[Sample]] = defaultdict(list)

    def _page(self, after: int, limit: int) -> SamplePage:
        try:
            r = self._client.get("/samples", params={"after": after, "group": self.groups, "limit": limit})
        except httpx.HTTPError as exc:
            raise SamplesUnavailable(f"router {self.url} did not serve /samples: {exc}") from None
        if r.status_code != 200:
            raise SamplesUnavailable(f"router {self.url} refused /samples: {r.status_code} {r.text[:200]}")
        return SamplePage.model_validate_json(r.content)

    def start(self) -> None:
        """From now on: later fetches return only requests that finish after this."""
        self._cursor = self._page(0, 0).next
        self.by_group.clear()

    def fetch(self) -> None:
        """Everything new since the last fetch; a router that dropped some of it (a tiny buffer, or a step
        so long its samples rolled out) is an error, not a silently thinner sample."""
        while True:
            page = self._page(self._cursor, PAGE)
            if page.dropped:
                raise SamplesUnavailable(f"router {self.url} dropped {page.dropped} samples of this step before "
                                         "they were read; check more often or raise its buffer")
            for s in page.samples:
                self.by_group[s.group].append(s)
            self._cursor = page.next
            if len(page.samples) < PAGE:
                return

    def of(self, group: str) -> Samples:
        return Samples.of(self.by_group.get(group, []))

    def close(self) -> None:
        self._client.close()
