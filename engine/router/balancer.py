"""Per-stage load balancers inside one group: prefill (cache affinity vs queued tokens), decode, encoder."""

from __future__ import annotations

from collections import OrderedDict

from engine.router.registry import EndpointState


class PrefillBalancer:
    """Sends a prompt where its leading blocks were prefilled before, unless that worker is
    more than `threshold` queued prefill tokens busier than the least loaded one."""

    def __init__(self, threshold_tokens: int, capacity: int = 100_000) -> None:
        self.threshold = threshold_tokens
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> endpoint url (LRU)
        self.capacity = capacity

    def choose(self, candidates: list[EndpointState], block_hashes: list[int]) -> EndpointState:
        least = min(candidates, key=prefill_load)
        by_url = {c.endpoint.url: c for c in candidates}
        matched: dict[str, int] = {}
        for h in block_hashes:
            url = self._owner.get(h)
            if url not in by_url:
                break
            matched[url] = matched.get(url, 0) + 1
        if matched:
            best = by_url[max(matched, key=matched.get)]
            if prefill_load(best) - prefill_load(least) <= self.threshold:
                return best
        return least

    def record(self, endpoint: EndpointState, block_hashes: list[int]) -> None:
        for h in block_hashes:
            self._owner[h] = endpoint.endpoint.url
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


def prefill_load(e: EndpointState) -> int:
    return e.queued_prefill_tokens + int(e.stats.get("queued_prefill_tokens", 0))


class DecodeBalancer:
    """Most free KV blocks wins; running sequences and router-side in-flight requests count against."""

    def choose(self, candidates: list[EndpointState]) -> EndpointState:
        return max(candidates, key=lambda e: (int(e.stats.get("kv_blocks_free", 0)) - 4 * (int(e.stats.get("running", 0)) + e.inflight),
                                              -e.inflight))


class LeastQueuedBalancer:
    """Encoder LB: fewest images queued (router-tracked in-flight plus the worker's own queue)."""

    def choose(self, candidates: list[EndpointState]) -> EndpointState:
        return min(candidates, key=lambda e: e.inflight + int(e.stats.get("queued", 0)))
