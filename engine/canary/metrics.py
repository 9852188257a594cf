"""Per-step canary figures (requests, error rate, TTFT/TPOT p99, throughput) per group, from two sources.

A window's figures come from the cumulative totals at its two ends, each side summed per group
(a series absent at the start counts from 0; a drop, e.g. a rebuilt member, counts as 0). The
Prometheus source evaluates exactly that in PromQL with `@` timestamps and `histogram_quantile`; the
direct source diffs two scrapes of /metrics and interpolates buckets as Prometheus does. So both give
the same numbers for the same window. (`increase()` is not used: it extrapolates to the window edges
and misses what a series counted before its first scrape inside the window.)

Errors are what the router counted as error/timeout for the group plus the 5xx answers its engines
gave: the router retries those on another group, so they never reach its per-group request counter.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Callable, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from engine.runtime.http import bearer_client
from engine.router.admin import scrape_members

QUANTILE = 0.99
ROUTER_REQUESTS = "tideflow_router_requests_total"
ROUTER_TOKENS = "tideflow_router_output_tokens_total"
TTFT = "tideflow_router_time_to_first_token_seconds"
TPOT = "tideflow_router_time_per_output_token_seconds"
ENGINE_REQUESTS = "tideflow_requests_total"
ROUTER_ERROR_STATUSES = "error|timeout"
ENGINE_ERROR_STATUSES = "http_5.."


class GroupFigures(BaseModel):
    """One group's figures over one window."""

    group: str
    version: str = Field("", description="the group's version label")
    requests: float = Field(0.0, ge=0, description="requests the router counted for the group, plus 5xx answers it retried elsewhere")
    errors: float = Field(0.0, ge=0, description="router error/timeout outcomes plus engine 5xx answers")
    error_rate: float | None = Field(None, description="errors / requests; None without requests")
    ttft_p99_s: float | None = Field(None, description="p99 client-seen time to first token (streamed requests)")
    tpot_p99_s: float | None = Field(None, description="p99 client-seen time per output token")
    throughput_tps: float = Field(0.0, ge=0, description="output tokens relayed per second")
    window_s: float = Field(0.0, ge=0, description="length of the window")


class Totals(BaseModel):
    """Cumulative counters of one group at one instant (the direct source keeps these per mark)."""

    version: str = ""
    requests: float = 0.0
    errors: float = 0.0
    tokens: float = 0.0
    ttft: dict[float, float] = Field(default_factory=dict, description="cumulative bucket counts by upper bound")
    tpot: dict[float, float] = Field(default_factory=dict)


class Mark(BaseModel):
    """One end of a window: its unix time, and for the direct source the totals scraped then."""

    at: float
    totals: dict[str, Totals] = Field(default_factory=dict)


class MetricsSource(Protocol):
    def mark(self) -> Mark: ...

    def figures(self, start: Mark, end: Mark, groups: list[str]) -> dict[str, GroupFigures]: ...

    def close(self) -> None: ...


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile on cumulative buckets {upper bound: count}; None where it gives NaN."""
    if math.inf not in buckets or len(buckets) < 2:
        return None
    bounds = sorted(buckets)
    counts, top = [], 0.0
    for b in bounds:  # Prometheus forces monotonic cumulative counts the same way
        top = max(top, buckets[b])
        counts.append(top)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next((k for k in range(len(bounds) - 1) if counts[k] >= rank), len(bounds) - 1)
    if i == len(bounds) - 1:
        return bounds[-2]
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    start, count = 0.0, counts[i]
    if i > 0:
        start, count, rank = bounds[i - 1], counts[i] - counts[i - 1], rank - counts[i - 1]
    return start + (bounds[i] - start) * (rank / count)


def _figures(group: str, version: str, requests: float, errors: float, tokens: float, ttft: float | None,
             tpot: float | None, window_s: float) -> GroupFigures:
    return GroupFigures(group=group, version=version, requests=requests, errors=errors,
                        error_rate=errors / requests if requests > 0 else None, ttft_p99_s=ttft, tpot_p99_s=tpot,
                        throughput_tps=tokens / window_s if window_s > 0 else 0.0, window_s=window_s)


# -- direct: scrape /metrics ---------------------------------------------------------------------------

def totals_from_exposition(texts: list[str]) -> dict[str, Totals]:
    """Per-group totals from Prometheus text expositions of the router and of engine members."""
    out: dict[str, Totals] = defaultdict(Totals)
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                group = s.labels.get("group")
                if not group:
                    continue
                t = out[group]
                t.version = t.version or s.labels.get("version", "")
                status = s.labels.get("status", "")
                if s.name == ROUTER_REQUESTS:
                    t.requests += s.value
                    if status in ROUTER_ERROR_STATUSES.split("|"):
                        t.errors += s.value
                elif s.name == ENGINE_REQUESTS and status.startswith("http_5"):
                    t.requests += s.value
                    t.errors += s.value
                elif s.name == ROUTER_TOKENS:
                    t.tokens += s.value
                elif s.name in (TTFT + "_bucket", TPOT + "_bucket"):
                    buckets = t.ttft if s.name.startswith(TTFT) else t.tpot
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    return dict(out)


class DirectSource:
    """Scrapes every router replica's /metrics at each mark (each where it alone answers, summed), plus the
    members' expositions from `member_texts` (the members' key stays with whoever runs them: a group set in this
    process, or the controller). A replica that died between two marks takes its counts with it: the step's
    figures are for people, the judge reads samples."""

    def __init__(self, router_urls: str | Callable[[], list[str]], router_key: str,
                 member_texts: Callable[[], list[str]] | None = None, timeout_s: float = 5.0) -> None:
        self.router_urls = (lambda: [router_urls]) if isinstance(router_urls, str) else router_urls
        self.member_texts = member_texts
        self._client = bearer_client(router_key, timeout_s=timeout_s)
        self._closers: list[Callable[[], None]] = []

    @classmethod
    def for_groupset(cls, groupset) -> "DirectSource":
        """Router and members of a LocalGroupSet, with the keys it holds."""
        members = bearer_client(groupset.member_key)
        source = cls(groupset.url, groupset.client_key, lambda: scrape_members(members, groupset.admin.groups()))
        source._closers.append(members.close)
        return source

    @classmethod
    def for_controller(cls, client, router_key: str) -> "DirectSource":
        """Router replicas (as the controller lists them) scraped here; members scraped by the controller, which
        holds their key."""
        return cls(lambda: client.status().replica_urls(), router_key, client.member_metrics)

    def mark(self) -> Mark:
        at = time.time()
        texts, urls = [], self.router_urls()
        for url in urls:
            try:
                r = self._client.get(url.rstrip("/") + "/metrics")
            except httpx.TransportError:
                if url == urls[-1] and not texts:
                    raise
                continue  # a replica gone since the controller listed it
            r.raise_for_status()
            texts.append(r.text)
        texts += self.member_texts() if self.member_texts is not None else []
        return Mark(at=at, totals=totals_from_exposition(texts))

    def figures(self, start: Mark, end: Mark, groups: list[str]) -> dict[str, GroupFigures]:
        window = end.at - start.at
        out = {}
        for g in groups:
            a, b = start.totals.get(g, Totals()), end.totals.get(g, Totals())
            ttft = {le: max(0.0, n - a.ttft.get(le, 0.0)) for le, n in b.ttft.items()}
            tpot = {le: max(0.0, n - a.tpot.get(le, 0.0)) for le, n in b.tpot.items()}
            out[g] = _figures(g, b.version or a.version, max(0.0, b.requests - a.requests), max(0.0, b.errors - a.errors),
                              max(0.0, b.tokens - a.tokens), histogram_quantile(QUANTILE, ttft),
                              histogram_quantile(QUANTILE, tpot), window)
        return out

    def close(self) -> None:
        self._client.close()
        for close in self._closers:
            close()


# -- Prometheus: PromQL over the same series ---------------------------------------------------------------

def _delta(selector: str, by: str, start: float, end: float) -> str:
    """PromQL: the per-`by` sum of `selector` at `end` less the same at `start` (0 where absent then)."""
    at_end = f"sum by ({by}) ({selector} @ {end:.3f})"
    at_start = f"sum by ({by}) ({selector} @ {start:.3f})"
    return f"clamp_min({at_end} - ({at_start} or {at_end} * 0), 0)"


class PrometheusSource:
    """The same figures through prometheus-api-client, from a Prometheus that scrapes router and engines."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
        from prometheus_api_client import PrometheusConnect

        self._prom = PrometheusConnect(url=url, headers=headers, disable_ssl=True, timeout=timeout_s)

    def close(self) -> None:
        """Nothing held open: each query is its own request."""

    def mark(self) -> Mark:
        return Mark(at=time.time())

    def _query(self, promql: str, at: float) -> list[tuple[dict, float]]:
        return [(r["metric"], float(r["value"][1])) for r in self._prom.custom_query(promql, params={"time": f"{at:.3f}"})]

    def figures(self, start: Mark, end: Mark, groups: list[str]) -> dict[str, GroupFigures]:
        s, e = start.at, end.at
        match = f'group=~"{"|".join(groups)}"'
        by = "group, version"

        versions: dict[str, str] = {}

        def per_group(promql: str, quantile: bool = False) -> dict[str, float]:
            values: dict[str, float] = defaultdict(float)
            for labels, value in self._query(promql, e):
                versions.setdefault(labels["group"], labels.get("version", ""))
                if not math.isnan(value):  # a quantile over no observations
                    values[labels["group"]] = value if quantile else values[labels["group"]] + value
            return values

        requests = per_group(_delta(f"{ROUTER_REQUESTS}{{{match}}}", by, s, e))
        errors = per_group(_delta(f'{ROUTER_REQUESTS}{{{match},status=~"{ROUTER_ERROR_STATUSES}"}}', by, s, e))
        failed = per_group(_delta(f'{ENGINE_REQUESTS}{{{match},status=~"{ENGINE_ERROR_STATUSES}"}}', by, s, e))
        tokens = per_group(_delta(f"{ROUTER_TOKENS}{{{match}}}", by, s, e))
        ttft = per_group(f"histogram_quantile({QUANTILE}, {_delta(f'{TTFT}_bucket{{{match}}}', 'le, ' + by, s, e)})", True)
        tpot = per_group(f"histogram_quantile({QUANTILE}, {_delta(f'{TPOT}_bucket{{{match}}}', 'le, ' + by, s, e)})", True)
        return {g: _figures(g, versions.get(g, ""), requests.get(g, 0.0) + failed.get(g, 0.0),
                            errors.get(g, 0.0) + failed.get(g, 0.0), tokens.get(g, 0.0), ttft.get(g), tpot.get(g), e - s)
                for g in groups}

