"""Router policies in isolation: weighted group choice, stage balancers, per-key limiter."""

from __future__ import annotations

from collections import Counter

from engine.router.balancer import DecodeBalancer, PrefillBalancer
from engine.router.ratelimit import RateLimiter
from engine.router.registry import Endpoint, EndpointState, GroupRegistration, Registry


def reg(name, weight, role="colocated", n=1):
    return GroupRegistration(name=name, version="v1", weight=weight,
                             endpoints=[Endpoint(url=f"http://127.0.0.1:{9000 + i}", role=role, instance=i) for i in range(n)])


def test_weighted_choice_gives_exact_shares_interleaved():
    r = Registry()
    r.register(reg("stable", 95))
    r.register(reg("canary", 5))
    picks = [r.choose().reg.name for _ in range(200)]
    assert Counter(picks) == {"stable": 190, "canary": 10}
    canary_at = [i for i, p in enumerate(picks) if p == "canary"]
    assert max(b - a for a, b in zip(canary_at, canary_at[1:])) <= 21  # spread out, not bunched


def test_zero_weight_and_unhealthy_member_take_group_out():
    r = Registry()
    r.register(reg("a", 1, n=2))
    r.register(reg("b", 1))
    r.set_weights({"b": 0})
    assert {r.choose().reg.name for _ in range(5)} == {"a"}
    r.get("a").endpoints[1].healthy = False  # one member down: the whole group is out
    assert r.choose() is None


def test_prefill_affinity_until_load_gap_exceeds_threshold():
    lb = PrefillBalancer(threshold_tokens=100)
    a, b = (EndpointState(Endpoint(url=f"http://127.0.0.1:{p}", role="prefill")) for p in (1, 2))
    hashes = [11, 22, 33]
    lb.record(b, hashes)
    a.queued_prefill_tokens, b.queued_prefill_tokens = 0, 80
    assert lb.choose([a, b], hashes) is b  # cache affinity wins within the threshold
    b.queued_prefill_tokens = 500
    assert lb.choose([a, b], hashes) is a  # too busy: balance by queued tokens
    assert lb.choose([a, b], [99]) is a  # no affinity: least queued


def test_decode_prefers_free_blocks_and_fewer_running():
    lb = DecodeBalancer()
    a, b = (EndpointState(Endpoint(url=f"http://127.0.0.1:{p}", role="decode")) for p in (1, 2))
    a.stats, b.stats = {"kv_blocks_free": 100, "running": 2}, {"kv_blocks_free": 300, "running": 2}
    assert lb.choose([a, b]) is b
    b.stats["running"] = 60
    assert lb.choose([a, b]) is a


def test_rate_limiter_per_key_bucket():
    lim = RateLimiter(rate_per_s=0.001, burst=3)
    assert [lim.allow("k1") for _ in range(4)] == [True, True, True, False]
    assert lim.allow("k2")
