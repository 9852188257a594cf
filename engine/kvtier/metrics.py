"""What the KV tiers report, per tier (host, disk, store), on the engine's own registry: the hit rate in tokens,
the bytes held, the blocks moved each way and how long that took, and every block dropped or not trusted."""

from __future__ import annotations

from engine.telemetry.metrics import MetricFactory

FALLBACK_REASONS = ("corrupt", "unavailable", "missing")


class TierMetrics:
    def __init__(self, factory: MetricFactory) -> None:
        f = factory
        self.queried = f.labelled_counter("kv_tier_queried_tokens_total",
                                          "prompt tokens looked up in a tier (those the tiers above did not hold)", "tier")
        self.hit = f.labelled_counter("kv_tier_hit_tokens_total", "looked-up prompt tokens the tier held", "tier")
        self.used = f.labelled_gauge("kv_tier_bytes", "bytes a tier holds (host, disk)", "tier")
        self.capacity = f.labelled_gauge("kv_tier_capacity_bytes", "bytes a tier may hold (host, disk)", "tier")
        self.offloaded = f.labelled_counter("kv_tier_offload_blocks_total", "blocks written to a tier", "tier")
        self.offload_skipped = f.labelled_counter(
            "kv_tier_offload_skipped_blocks_total", "blocks not written because the offload queue was full", "tier")
        self.offload_seconds = f.labelled_histogram("kv_tier_offload_seconds", "time to write one block", "tier")
        self.onboarded = f.labelled_counter("kv_tier_onboard_blocks_total", "blocks loaded from a tier", "tier")
        self.onboard_seconds = f.labelled_histogram(
            "kv_tier_onboard_seconds", "time to load one request's run of blocks from a tier", "tier")
        self.evictions = f.labelled_counter("kv_tier_evictions_total", "blocks a tier dropped for room", "tier")
        self.expirations = f.labelled_counter("kv_tier_expirations_total", "blocks a tier dropped for age", "tier")
        self.fallbacks = f.labelled_counter(
            "kv_tier_fallbacks_total", "blocks recomputed instead of loaded: corrupt, unavailable (the tier did not "
                                       "answer) or missing (indexed but gone)", "tier", "reason")
        self.write_errors = f.labelled_counter("kv_tier_write_errors_total", "block writes a tier refused", "tier")
        self.read_cost = f.labelled_gauge(
            "kv_tier_read_seconds_per_block", "startup-measured time to load one block from a tier", "tier")

    def show(self, tiers: list[str]) -> None:
        """Every series of these tiers exists from the start, at 0: a dashboard or an alert reading one that never
        moved sees a zero, not nothing."""
        for tier in tiers:
            for family in (self.queried, self.hit, self.offloaded, self.offload_skipped, self.offload_seconds,
                           self.onboarded, self.onboard_seconds, self.evictions, self.expirations, self.write_errors):
                family.labels(tier)
            for reason in FALLBACK_REASONS:
                self.fallbacks.labels(tier, reason)
