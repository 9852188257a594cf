"""What the autoscaler reads each tick: engine queues and batches (/internal/stats) and the router's TTFT.

TTFT p99 is taken over the window since the previous reading: the difference of the router's
cumulative histogram buckets, interpolated the way Prometheus' histogram_quantile does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime.http import bearer_client
from engine.scaling.policy import Observation

TTFT_METRIC = "tideflow_router_time_to_first_token_seconds"


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a histogram given as cumulative (upper bound, count) pairs; None when empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # past the last finite bound: that bound is all a histogram can say
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return lower


def ttft_buckets(metrics_text: str) -> dict[float, float]:
    """Cumulative TTFT bucket counts summed over every group and version."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != TTFT_METRIC:
            continue
        for sample in family.samples:
            if sample.name == TTFT_METRIC + "_bucket":
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


class SetObserver:
    """Reads one group set: `member_urls()` names the serving members to ask for their stats, `router_urls()`
    the router replicas to read TTFTs from (each where it alone answers: replicas sharing a port count apart)."""

    def __init__(self, router_urls: Callable[[], list[str]], client_key: str | Callable[[], str], member_key: str | Callable[[], str],
                 member_urls: Callable[[], list[str]], timeout_s: float = 2.0) -> None:
        """`client_key`: the router's client key, or what gives it now (a rotated key is followed)."""
        self.router_urls, self.member_urls = router_urls, member_urls
        self.client_key = (lambda: client_key) if isinstance(client_key, str) else client_key
        self._router = bearer_client(self.client_key(), timeout_s=timeout_s)
        self._members = bearer_client(member_key, timeout_s=timeout_s)
        self._last: dict[str, dict[float, float]] = {}  # replica URL -> its TTFT buckets at the last look

    def __call__(self) -> Observation:
        queued = running = 0
        for url in self.member_urls():
            try:
                stats = self._members.get(url + "/internal/stats").json()
            except (httpx.HTTPError, ValueError):
                continue  # a member that does not answer counts nothing; its group's health is the manager's job
            queued += int(stats.get("queued", 0))
            running += int(stats.get("running", 0))
        return Observation(queued=queued, running=running, ttft_p99_ms=self._ttft_p99_ms())

    def _ttft_p99_ms(self) -> float | None:
        """The p99 of the TTFTs every replica measured since the last look (a replica new since then: since its
        start; one that does not answer counts nothing)."""
        window: dict[float, float] = {}
        seen: dict[str, dict[float, float]] = {}
        self._router.headers["authorization"] = f"Bearer {self.client_key()}"
        for url in self.router_urls():
            try:
                now = ttft_buckets(self._router.get(url.rstrip("/") + "/metrics").text)
            except httpx.HTTPError:
                continue
            last = self._last.get(url, {})
            for le, count in now.items():
                window[le] = window.get(le, 0.0) + max(0.0, count - last.get(le, 0.0))
            seen[url] = now
        self._last = seen
        if not seen:
            return None
        p99 = bucket_quantile(0.99, sorted(window.items()))
        return None if p99 is None else p99 * 1000

    def close(self) -> None:
        self._router.close()
        self._members.close()
