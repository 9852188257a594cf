"""Precise KV-aware routing: a prompt goes to the member that holds most of it (nearest tier first) unless load
outweighs it, the shared store counts for every member, and a member whose feed went quiet sends the choice back to
the router's approximate affinity. Then the same with two real member processes and a router process."""

from __future__ import annotations

import random
import time

import httpx
import openai
import pytest

from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok
from engine.router.app import ADMIN_KEYS_ENV, UPSTREAM_KEY_ENV
from engine.router.kv_index import KVIndex, KVRouter, KVRoutingConfig
from engine.router.registry import Endpoint, EndpointState

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

BLOCK = 16


def members(n: int = 2) -> list[EndpointState]:
    return [EndpointState(Endpoint(url=f"http://127.0.0.1:{9100 + i}", role="colocated")) for i in range(n)]


def feed(index: KVIndex, member: EndpointState, now: float = 0.0, **tiers: list[int]) -> None:
    index.apply(member.endpoint.url, {"epoch": "e", "seq": 1, "reset": True, "held": tiers}, now=now)


def router(mode: str = "precise") -> tuple[KVRouter, KVIndex]:
    index = KVIndex()
    return KVRouter(KVRoutingConfig(mode=mode), index, BLOCK), index


def test_the_member_holding_the_longest_run_wins_nearest_tier_first(monkeypatch):
    monkeypatch.setattr("engine.router.kv_index.time.monotonic", lambda: 1.0)
    kv, index = router()
    a, b = members()
    feed(index, a, device=[1, 2])
    feed(index, b, host=[1, 2, 3, 4])
    assert kv.choose([a, b], [1, 2, 3, 4, 5], colocated=True) is b  # 4 blocks from host beat 2 on the device
    feed(index, a, device=[1, 2, 3, 4])
    assert kv.choose([a, b], [1, 2, 3, 4, 5], colocated=True) is a  # the same run on the device is cheaper
    feed(index, a, device=[2, 3, 4])
    assert kv.choose([a, b], [1, 2, 3, 4, 5], colocated=True) is b  # a run starts at the first block
    assert kv.choices["precise"] == 3


def test_load_outweighs_a_held_prefix_and_the_store_counts_for_everyone(monkeypatch):
    monkeypatch.setattr("engine.router.kv_index.time.monotonic", lambda: 1.0)
    kv, index = router()
    a, b = members()
    feed(index, a, device=list(range(10)))
    feed(index, b)
    hashes = list(range(10))
    assert kv.choose([a, b], hashes, colocated=True) is a
    a.stats = {"queued_prefill_tokens": 10 * BLOCK + 1, "running": 0}  # more queued than the prefix saves
    assert kv.choose([a, b], hashes, colocated=True) is b
    a.stats = {}
    feed(index, a, store=list(range(10)))  # a wrote them to the shared store: b can read them as well as a
    b.stats = {"running": 1}
    assert kv.choose([a, b], hashes, colocated=True) is a
    assert kv.cost(b, hashes, [a, b]) == pytest.approx(10 * 0.4 * BLOCK + 32)


def test_a_quiet_feed_falls_back_to_where_the_router_sent_the_prefix(monkeypatch):
    clock = [1.0]
    monkeypatch.setattr("engine.router.kv_index.time.monotonic", lambda: clock[0])
    kv, index = router()
    a, b = members()
    feed(index, a, now=1.0, device=[1, 2, 3])
    feed(index, b, now=1.0)
    kv.record(b, [1, 2, 3])  # the router once sent this prefix to b
    assert kv.choose([a, b], [1, 2, 3], colocated=True) is a
    clock[0] = 10.0  # both feeds older than stale_after_s (5 s)
    assert kv.choose([a, b], [1, 2, 3], colocated=True) is b
    assert kv.choices == {"precise": 1, "approximate": 1, "least-queued": 0}


def test_least_queued_ignores_the_kv_and_approximate_ignores_the_feeds(monkeypatch):
    monkeypatch.setattr("engine.router.kv_index.time.monotonic", lambda: 1.0)
    kv, index = router("least-queued")
    a, b = members()
    feed(index, a, device=[1, 2])
    a.inflight = 3
    assert kv.choose([a, b], [1, 2], colocated=True) is b
    kv, index = router("approximate")
    feed(index, a, device=[1, 2])
    kv.record(b, [1, 2])
    assert kv.choose([a, b], [1, 2], colocated=True) is b
    assert kv.choices["approximate"] == 1


@pytest.fixture(scope="module")
def two_members_and_a_router(tiny_model_dir, tmp_path_factory):
    """Two `tideflow serve` processes of the tiny model (KV for 24 blocks, host memory below it) behind a
    `tideflow router` process reading their KV feeds; yields the router's URL and the members' URLs."""
    logs = tmp_path_factory.mktemp("kv-routing")
    store = logs / "shared-store"
    key, admin = "member-and-client-key", "admin-key"
    env = {"TIDEFLOW_API_KEYS": key}
    children, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            argv = tideflow_argv("serve", "--model", str(tiny_model_dir), "--port", str(port), "--block-size",
                                 str(BLOCK), "--kv-cache-bytes", str(40 * 8192), "--kv-host-bytes", str(1 << 20),
                                 "--kv-store-url", store.as_uri() + "/", "--served-model-name", "default")
            children.append(Child(f"member-{i}", argv, logs / f"member-{i}.log", env))
            urls.append(f"http://127.0.0.1:{port}")
        for child, url in zip(children, urls):
            assert wait_http_ok(url + "/ready", 120, child), child.log_tail()
        port = free_port()
        argv = tideflow_argv("router", "--port", str(port), "--model-dir", str(tiny_model_dir),
                             "--health-interval-s", "0.2", "--kv-routing", "precise")
        children.append(Child("router", argv, logs / "router.log",
                              {**env, ADMIN_KEYS_ENV: admin, UPSTREAM_KEY_ENV: key}))
        router_url = f"http://127.0.0.1:{port}"
        assert wait_http_ok(router_url + "/health", 60, children[-1]), children[-1].log_tail()
        endpoints = [{"url": u, "role": "colocated"} for u in urls]
        r = httpx.post(router_url + "/admin/groups", headers={"authorization": f"Bearer {admin}"}, trust_env=False,
                       json={"name": "pair", "version": "v1", "weight": 1.0, "endpoints": endpoints})
        assert r.status_code == 200, r.text
        yield router_url, urls, key, admin, store
    finally:
        for child in children:
            child.stop()


def test_each_conversation_comes_back_to_the_member_holding_it(two_members_and_a_router):
    """Six conversations' first turns are sent straight to the members, alternately: the router never saw them, so
    it can only know where their blocks are from the members' feeds. Each second turn, through the router, finds its
    first turn's 10 blocks only where the router sends it to that member: by load alone (least-queued) or by its own
    memory (approximate), every second turn would go to the first member, and half would compute everything."""
    router_url, urls, key, admin, _ = two_members_and_a_router
    rng = random.Random(11)
    firsts = [[rng.randrange(3, 500) for _ in range(10 * BLOCK)] for _ in range(6)]
    for i, prompt in enumerate(firsts):
        direct = openai.OpenAI(base_url=urls[i % 2] + "/v1", api_key=key, max_retries=0,
                               http_client=httpx.Client(trust_env=False, timeout=60))
        assert direct.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0).choices
    wait_until_read(router_url, admin, urls, key)
    client = openai.OpenAI(base_url=router_url + "/v1", api_key=key, max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=60))
    cached = []
    for prompt in firsts:
        second = prompt + [rng.randrange(3, 500) for _ in range(BLOCK)]
        answer = client.completions.create(model="default", prompt=second, max_tokens=2, temperature=0)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
    assert all(c >= 9 * BLOCK for c in cached), cached
    index = httpx.get(router_url + "/admin/kv-index", headers={"authorization": f"Bearer {admin}"},
                      trust_env=False).json()
    assert index["choices"]["precise"] == 6 and index["choices"]["approximate"] == 0, index


def wait_until_read(router_url: str, admin: str, urls: list[str], key: str, timeout_s: float = 30.0) -> None:
    """Until the router's cursor on each member's feed is the member's last event (nothing newer to read)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=10) as http:
        while True:
            known = http.get(router_url + "/admin/kv-index", headers={"authorization": f"Bearer {admin}"}).json()
            behind = []
            for url in urls:
                cursor = known["members"].get(url)
                page = None if cursor is None else http.get(
                    url + "/internal/kv-events", params={"epoch": cursor["epoch"], "after": cursor["seq"]},
                    headers={"authorization": f"Bearer {key}"}).json()
                if page is None or page["reset"] or page["events"]:
                    behind.append(url)
            if not behind:
                return
            assert time.monotonic() < deadline, f"the router has not read {behind}: {known}"
            time.sleep(0.1)


def test_a_member_reads_what_the_other_wrote_to_the_shared_store(two_members_and_a_router):
    """A prompt used twice on one member (the store admits a block at its second use) is written to the shared
    store; the other member, which never saw it, loads its blocks from there instead of computing them."""
    _, urls, key, _, store = two_members_and_a_router
    rng = random.Random(12)
    prompt = [rng.randrange(3, 500) for _ in range(8 * BLOCK)]
    clients = [openai.OpenAI(base_url=u + "/v1", api_key=key, max_retries=0,
                             http_client=httpx.Client(trust_env=False, timeout=60)) for u in urls]
    for _ in range(2):
        clients[0].completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.monotonic() + 30
    while len([p for p in store.rglob("*") if p.is_file()]) < 7:  # the writer thread's blocks reached the store
        assert time.monotonic() < deadline, sorted(store.rglob("*"))
        time.sleep(0.1)
    answer = clients[1].completions.create(model="default", prompt=prompt + [7] * BLOCK, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 7 * BLOCK
    metrics = httpx.get(urls[1] + "/metrics", headers={"authorization": f"Bearer {key}"}, trust_env=False).text
    hits = [line for line in metrics.splitlines()
            if line.startswith("tideflow_kv_tier_hit_tokens_total") and 'tier="store"' in line]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 7 * BLOCK, hits

