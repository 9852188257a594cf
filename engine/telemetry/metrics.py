"""The project's one Prometheus registry module: metric factories with constant labels.

Every process (engine server, router) creates its metrics through `MetricFactory` on its own
`CollectorRegistry`, so a scrape carries group/version/role labels on every series.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONST_LABELS = ("group", "version", "role")


class MetricFactory:
    """Creates `tideflow_*` metrics on one registry, bound to constant labels."""

    def __init__(self, registry: CollectorRegistry | None = None, group: str = "", version: str = "", role: str = "colocated") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.const = {"group": group, "version": version, "role": role}

    def histogram(self, name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
        return Histogram(f"tideflow_{name}", doc, CONST_LABELS, buckets=buckets, registry=self.registry).labels(**self.const)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"tideflow_{name}", doc, CONST_LABELS, registry=self.registry).labels(**self.const)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(f"tideflow_{name}", doc, CONST_LABELS, registry=self.registry).labels(**self.const)

    def labelled_counter(self, name: str, doc: str, *labels: str):
        """A counter with free labels (e.g. status); call `.labels(*values)` on the result."""
        parent = Counter(f"tideflow_{name}", doc, (*CONST_LABELS, *labels), registry=self.registry)
        return _Bound(parent, self.const)

    def labelled_gauge(self, name: str, doc: str, *labels: str):
        parent = Gauge(f"tideflow_{name}", doc, (*CONST_LABELS, *labels), registry=self.registry)
        return _Bound(parent, self.const)

    def labelled_histogram(self, name: str, doc: str, *labels: str, buckets=LATENCY_BUCKETS):
        parent = Histogram(f"tideflow_{name}", doc, (*CONST_LABELS, *labels), buckets=buckets, registry=self.registry)
        return _Bound(parent, self.const)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Bound:
    def __init__(self, parent: Counter | Gauge | Histogram, const: dict[str, str]) -> None:
        self.parent, self.const = parent, const

    def labels(self, *values: str):
        return self.parent.labels(*self.const.values(), *values)


class ServingMetrics:
    """What one serving engine reports: latencies, queue and batch shape, KV use, prefix cache."""

    def __init__(self, factory: MetricFactory | None = None) -> None:
        f = self.factory = factory if factory is not None else MetricFactory()
        self.ttft = f.histogram("time_to_first_token_seconds", "arrival to first generated token")
        self.tpot = f.histogram("time_per_output_token_seconds", "mean time per token after the first, per request")
        self.itl = f.histogram("inter_token_latency_seconds", "time between consecutive tokens of a request")
        self.e2e = f.histogram("e2e_request_latency_seconds", "arrival to last token")
        self.queue_depth = f.gauge("queue_depth", "requests waiting (shuttle window + queue)")
        self.running = f.gauge("running_sequences", "sequences in the running batch")
        self.kv_used = f.gauge("kv_blocks_used", "KV cache blocks referenced by sequences")
        self.kv_free = f.gauge("kv_blocks_free", "KV cache blocks free or evictable")
        self.prefix_queried = f.counter("prefix_cache_queried_blocks_total", "full blocks looked up in the prefix cache")
        self.prefix_hit = f.counter("prefix_cache_hit_blocks_total", "looked-up blocks found in the prefix cache")
        self.batch_size = f.histogram("batch_size", "sequences per model step", SIZE_BUCKETS)
        self.departure_size = f.histogram("departure_size", "arrivals per shuttle departure", SIZE_BUCKETS)
        self.prompt_tokens = f.counter("prompt_tokens_total", "prompt tokens of accepted requests")
        self.prefill_tokens = f.counter("prefill_computed_tokens_total", "prompt tokens computed (not from the cache, recompute included)")
        self.generation_tokens = f.counter("generation_tokens_total", "tokens generated")
        self.preemptions = f.counter("preemptions_total", "sequences preempted by recompute")
        self.kv_transfer_bytes = f.counter("kv_transfer_bytes_total", "KV cache bytes this decode member pulled")
        self.kv_transfer_seconds = f.histogram("kv_transfer_seconds", "time to pull one request's KV from prefill")
        self.kv_transfer_failures = f.counter("kv_transfer_failures_total", "KV pulls that failed or timed out")
        self.kv_transfer_skipped_blocks = f.counter(
            "kv_transfer_skipped_blocks_total", "prompt blocks this decode member held, so prefill did not send them")
        self.kv_transfer_recomputes = f.counter(
            "kv_transfer_recomputes_total", "prefilled requests whose skipped blocks were evicted here before they "
                                            "arrived: recomputed by this decode member")
        self.requests = f.labelled_counter("requests_total", "finished requests by status", "status")

    def render(self) -> tuple[bytes, str]:
        return self.factory.render()

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample of this engine's series (0 when never observed)."""
        found = self.factory.registry.get_sample_value(name, self.factory.const | labels)
        return found or 0.0
