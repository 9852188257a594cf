"""Precise KV-aware routing: which member holds which blocks (from their KV event feeds, engine.core.kv_events), and
the member a prompt costs least on: the blocks it would still have to compute, the blocks it would load from a tier
below its KV cache (each at a share of a computed block's cost), and the load it carries.

Where a candidate's feed is missing or has gone quiet (stale_after_s), the choice falls back to the approximate
affinity the router keeps itself: the members it sent each block's prompts to (PrefillBalancer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from engine.router.balancer import LeastQueuedBalancer, PrefillBalancer, prefill_load
from engine.router.registry import EndpointState


class KVRoutingConfig(BaseModel):
    """How prompts are placed on the members of a group by the KV they hold."""

    mode: Literal["precise", "approximate", "least-queued"] = Field(
        "precise", description="precise: by the members' KV event feeds (what each holds, in which tier); "
                               "approximate: by where the router sent a prompt's blocks before; least-queued: by load "
                               "alone (colocated members; a prefill member is placed approximately then)")
    host_cost: float = Field(0.05, ge=0, le=1, description="loading a block from host memory, as a share of computing it")
    disk_cost: float = Field(0.15, ge=0, le=1, description="loading a block from local disk, as a share of computing it")
    store_cost: float = Field(0.4, ge=0, le=1, description="loading a block from the shared store, as a share of "
                                                           "computing it")
    running_tokens: int = Field(32, ge=0, description="each sequence a member runs weighs as this many queued tokens")
    stale_after_s: float = Field(5.0, gt=0, description="a feed not heard from this long is not trusted")
    approximate_threshold_tokens: int = Field(
        2048, ge=0, description="approximate: the queued-token gap beyond which load beats where the prefix went")


@dataclass
class _Feed:
    epoch: str = ""
    seq: int = 0
    heard: float | None = None
    tiers: dict[str, set[int]] = field(default_factory=dict)


class KVIndex:
    """Per member URL, the blocks each tier holds. Written by the router's health loop, read by its balancers (one
    event loop: no lock)."""

    def __init__(self) -> None:
        self._feeds: dict[str, _Feed] = {}

    def cursor(self, url: str) -> tuple[str, int]:
        feed = self._feeds.get(url)
        return (feed.epoch, feed.seq) if feed is not None else ("", 0)

    def apply(self, url: str, page: dict, now: float | None = None) -> None:
        """One page of a member's feed (engine.core.kv_events.KVEventPage as JSON)."""
        feed = self._feeds.setdefault(url, _Feed())
        if page.get("reset"):
            feed.tiers = {tier: set(hashes) for tier, hashes in page.get("held", {}).items()}
        for event in page.get("events", []):
            held = feed.tiers.setdefault(event["tier"], set())
            if event["kind"] == "stored":
                held.update(event["hashes"])
            else:
                held.difference_update(event["hashes"])
        feed.epoch, feed.seq = page["epoch"], page["seq"]
        feed.heard = time.monotonic() if now is None else now

    def silent(self, url: str) -> None:
        """The member answers no feed (an engine core in its own process, no prefix cache): nothing is known of it."""
        self._feeds.pop(url, None)

    def fresh(self, url: str, within_s: float, now: float) -> bool:
        feed = self._feeds.get(url)
        return feed is not None and feed.heard is not None and now - feed.heard <= within_s

    def summary(self, now: float) -> dict[str, dict]:
        """Per member: its feed's cursor, how long ago it was heard, and the blocks each tier holds (operators
        reading why a prompt went where it went; tests waiting for the router to have read a feed)."""
        return {url: {"epoch": f.epoch, "seq": f.seq, "heard_s_ago": None if f.heard is None else now - f.heard,
                      "blocks": {tier: len(held) for tier, held in f.tiers.items()}} for url, f in self._feeds.items()}

    def tiers(self, url: str) -> dict[str, set[int]]:
        feed = self._feeds.get(url)
        return feed.tiers if feed is not None else {}

    def device_run(self, url: str, hashes: list[int], within_s: float, now: float) -> int:
        """How many of `hashes`, from the first, the member's KV cache holds; 0 unless its feed is fresh (a decode
        member is then sent every block, which is always right)."""
        if not self.fresh(url, within_s, now):
            return 0
        held = self.tiers(url).get("device", set())
        run = 0
        for h in hashes:
            if h not in held:
                break
            run += 1
        return run


class KVRouter:
    """Places a prompt (its block hashes) on one of a group's members, by `config.mode`."""

    def __init__(self, config: KVRoutingConfig, index: KVIndex, block_size: int) -> None:
        self.config, self.index, self.block_size = config, index, block_size
        self.approximate = PrefillBalancer(config.approximate_threshold_tokens)
        self.least_queued = LeastQueuedBalancer()
        self.choices = {"precise": 0, "approximate": 0, "least-queued": 0}  # how each choice was made

    def choose(self, candidates: list[EndpointState], hashes: list[int], colocated: bool) -> EndpointState:
        mode = self.config.mode
        if mode == "least-queued" and colocated:
            self.choices["least-queued"] += 1
            return self.least_queued.choose(candidates)
        now = time.monotonic()
        if mode == "precise" and all(self.index.fresh(c.endpoint.url, self.config.stale_after_s, now)
                                     for c in candidates):
            self.choices["precise"] += 1
            return min(candidates, key=lambda c: (self.cost(c, hashes, candidates), c.inflight))
        self.choices["approximate"] += 1
        return self.approximate.choose(candidates, hashes)

    def held_by(self, member: EndpointState, hashes: list[int]) -> int:
        """The prompt's leading blocks a decode member holds, to be left out of its KV transfer (precise mode)."""
        if self.config.mode != "precise":
            return 0
        return self.index.device_run(member.endpoint.url, hashes, self.config.stale_after_s, time.monotonic())

    def record(self, target: EndpointState, hashes: list[int]) -> None:
        """Where a prompt went: the approximate affinity's memory (kept in every mode, for the fallback)."""
        self.approximate.record(target, hashes)

    def cost(self, member: EndpointState, hashes: list[int], group: list[EndpointState]) -> float:
        """In tokens: what the prompt's blocks cost on `member` (computed, or loaded from the nearest tier that holds
        them, a run from the first block), plus its queued prompt tokens and running sequences."""
        held = self.index.tiers(member.endpoint.url)
        shares = {"device": 0.0, "host": self.config.host_cost, "disk": self.config.disk_cost}
        stores = [self.index.tiers(c.endpoint.url).get("store", set()) for c in group]
        blocks = 0.0
        for i, h in enumerate(hashes):
            share = next((s for tier, s in shares.items() if h in held.get(tier, ())), None)
            if share is None and any(h in store for store in stores):
                share = self.config.store_cost
            if share is None:
                blocks += len(hashes) - i
                break
            blocks += share
        load = prefill_load(member) + self.config.running_tokens * int(member.stats.get("running", 0))
        return blocks * self.block_size + load
