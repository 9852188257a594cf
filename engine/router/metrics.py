"""What the router exports per group and version: the canary gates read these."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.router.samples import SampleLog
from engine.telemetry.metrics import LATENCY_BUCKETS

LABELS = ("group", "version")
STATUSES = ("ok", "error", "timeout", "rejected")  # a request's outcome (engine.router.proxy)
MIGRATION_REASONS = ("disconnect", "stall", "truncated", "bad_event", "error_event")  # why a stream moved
MIGRATION_STAGES = ("reopened", "first_token")  # from the break: another upstream answered; its first event relayed
MIGRATION_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class RouterMetrics:
    """The counters and histograms Prometheus scrapes, and the per-request samples the canary judge reads."""

    def __init__(self, registry: CollectorRegistry | None = None, samples: SampleLog | None = None) -> None:
        self.samples = samples if samples is not None else SampleLog()
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self._requests = Counter("tideflow_router_requests_total", "client requests by group, version and outcome",
                                 (*LABELS, "status"), registry=r)
        self._ttft = Histogram("tideflow_router_time_to_first_token_seconds", "client-seen time to first token",
                               LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram("tideflow_router_time_per_output_token_seconds", "client-seen time per output token",
                               LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("tideflow_router_e2e_request_latency_seconds", "client-seen request latency",
                              LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self._tokens = Counter("tideflow_router_output_tokens_total", "tokens relayed to clients", LABELS, registry=r)
        self._retries = Counter("tideflow_router_retries_total", "stage retries before any token was sent", LABELS, registry=r)
        self._migrations = Counter("tideflow_router_migrations_total",
                                   "requests moved to another worker mid-answer, by the group they left and why",
                                   (*LABELS, "reason"), registry=r)
        self.migration_s = Histogram(
            "tideflow_router_migration_seconds", "a moved stream's pause, from the break seen to `stage`: where a "
            "failover's time goes (reopened: the new upstream's response head came, after routing and connecting, "
            "and on a PD group the prefill instance's work; first_token: its first token relayed, after its queue "
            "and its prefill of prompt + answer so far)", ("group", "version", "stage"), buckets=MIGRATION_BUCKETS,
            registry=r)
        self.unrouted = Counter("tideflow_router_unrouted_total", "requests no group could serve", registry=r)
        self.rate_limited = Counter("tideflow_router_rate_limited_total", "requests refused by the per-key limiter", registry=r)
        self.group_weight = Gauge("tideflow_router_group_weight", "traffic weight per group", LABELS, registry=r)
        self.group_routable = Gauge("tideflow_router_group_routable", "1 when every member is healthy", LABELS, registry=r)

    def requests(self, group, status: str):
        return self._requests.labels(group.reg.name, group.reg.version, status)

    def retries(self, group):
        return self._retries.labels(group.reg.name, group.reg.version)

    def migrations(self, group, reason: str):
        return self._migrations.labels(group.reg.name, group.reg.version, reason)

    def failed_attempt(self, group) -> None:
        """A try on `group` that failed before any token (an engine 5xx, a refused connection): the request
        moves on to another group, and the judge counts an error against this one."""
        self.samples.add(group.reg.name, group.reg.version, ok=False)

    def observe(self, group, status: str, meter) -> None:
        labels = (group.reg.name, group.reg.version)
        self._requests.labels(*labels, status).inc()
        ok = status == "ok"
        self.samples.add(*labels, ok=ok, ttft=meter.ttft if ok else None, tpot=meter.tpot if ok else None,
                         e2e=meter.end - meter.t0 if ok and meter.end is not None else None)
        if not ok:
            return
        if meter.ttft is not None:
            self._ttft.labels(*labels).observe(meter.ttft)
        if meter.tpot is not None:
            self._tpot.labels(*labels).observe(meter.tpot)
        if meter.end is not None:
            self._e2e.labels(*labels).observe(meter.end - meter.t0)
        self._tokens.labels(*labels).inc(meter.tokens)

    def refresh(self, groups) -> None:
        for g in groups:
            labels = (g.reg.name, g.reg.version)
            for status in STATUSES:
                self._requests.labels(*labels, status)
            for reason in MIGRATION_REASONS:
                self._migrations.labels(*labels, reason)
            for series in (self._retries, self._tokens, self._ttft, self._tpot, self._e2e):
                series.labels(*labels)
            self.group_weight.labels(g.reg.name, g.reg.version).set(g.reg.weight)
            self.group_routable.labels(g.reg.name, g.reg.version).set(1 if g.routable else 0)
