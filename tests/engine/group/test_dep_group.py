"""DEP2 decode ranks as serving members: same greedy output as one process, live rebalances, atomic rebuilds."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.offline.default_model import TINY_CONFIG, write_default_model
from engine.offline.generate import generate
from engine.group.groupset import GroupSetConfig, LocalGroupSet
from engine.group.manager import GroupState, SupervisionPolicy
from engine.group.spec import InferenceGroup
from engine.model.loader import load_model
from engine.parallel.serving import EXIT_PEER_LOST
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import ChatMessage, Tokenizer

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

EIGHT_EXPERTS = TINY_CONFIG.model_copy(update={"num_experts": 8})
PROMPTS = [("the experts " * (1 + i % 5)) + f"request {i}" for i in range(16)]
MAX_TOKENS = [6 + (i * 7) % 18 for i in range(16)]
KEY = "dep-test-key"


@pytest.fixture(scope="module")
def moe8_dir(tmp_path_factory):
    return write_default_model(tmp_path_factory.mktemp("moe8"), EIGHT_EXPERTS, seed=1)


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i]}]


@pytest.fixture(scope="module")
def reference(moe8_dir):
    """Greedy output of one process holding every expert: even requests as completions, odd as chat."""
    model, tok = load_model(moe8_dir), Tokenizer(moe8_dir)
    prompts = [tok.encode(PROMPTS[i]) if i % 2 == 0 else
               tok.encode(tok.apply_chat_template([ChatMessage(**m) for m in _chat(i)])) for i in range(16)]
    outs = generate(model, tok, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return [o.text for o in outs]


@pytest.fixture(scope="module")
def groupset(moe8_dir, tideflow_home):
    policy = SupervisionPolicy(ready_timeout_s=90, max_restarts=2, backoff_s=0.2)
    with LocalGroupSet(GroupSetConfig(model_dir=Path(moe8_dir), model_name="default", policy=policy)) as gs:
        yield gs


def dep_spec(model_dir, name: str = "dep2", redundant_experts: int = 0) -> InferenceGroup:
    """Prefill, and a DEP2 decode instance rebalancing every few steps, so live EPLB moves experts under the
    running requests."""
    engine = {"kv_cache_bytes": 4_000_000, "max_wait_ms": 0}
    decode = {"role": "decode", "parallel": "DEP2", "engine": engine, "eplb_interval_steps": 4, "eplb_threshold": 1.0,
              "redundant_experts": redundant_experts}
    return InferenceGroup.model_validate({
        "name": name, "version": "v1", "model": {"path": str(model_dir)},
        "roles": [{"role": "prefill", "engine": engine}, decode]})


async def ask_all(url: str, key: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    async def one(i: int) -> str:
        common = dict(model="default", max_tokens=MAX_TOKENS[i], temperature=0, extra_body={"ignore_eos": True})
        stream = i % 4 >= 2
        if i % 2 == 0:
            if stream:
                chunks = await client.completions.create(prompt=PROMPTS[i], stream=True, **common)
                return "".join([c.choices[0].text async for c in chunks if c.choices])
            return (await client.completions.create(prompt=PROMPTS[i], **common)).choices[0].text
        if stream:
            chunks = await client.chat.completions.create(messages=_chat(i), stream=True, **common)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        return (await client.chat.completions.create(messages=_chat(i), **common)).choices[0].message.content

    try:
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    finally:
        await client.close()


def scrape(url: str, key: str) -> str:
    return httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=5, trust_env=False).text


def sample_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def test_dep2_decode_serves_like_one_process_and_rebuilds_whole(groupset, moe8_dir, reference):
    group = groupset.up(dep_spec(moe8_dir))
    try:
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        registered = {(e["role"], e["url"]) for g in groupset.admin.groups() for e in g["endpoints"]}
        decode_urls = sorted(u for r, u in registered if r == "decode")
        assert len(decode_urls) == 2, registered  # every rank is an endpoint of the decode LB

        assert asyncio.run(ask_all(groupset.url, groupset.client_key)) == reference

        member_key = groupset.backend.api_key
        scraped = [scrape(u, member_key) for u in decode_urls]
        assert all(sample_sum(s, "tideflow_expert_routed_tokens_total") > 0 for s in scraped)
        assert sample_sum(scraped[0], "tideflow_expert_rebalances_total") >= 1  # experts moved under live requests
        assert sample_sum(scraped[0], "tideflow_expert_rebalances_total") == sample_sum(scraped[1], "tideflow_expert_rebalances_total")

        old = groupset.backend.pids(group.status.handle)
        victim = next(pid for m, pid in old.items() if m.role == "decode" and m.rank == 1)
        os.kill(victim, signal.SIGKILL)
        assert group.wait_for({GroupState.STARTING}, 30) == GroupState.STARTING
        assert not any(g["name"] == "dep2" for g in groupset.admin.groups())  # out of the router at once
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        new = groupset.backend.pids(group.status.handle)
        assert len(new) == 3 and not set(new.values()) & set(old.values())  # the whole group is new

        texts = asyncio.run(ask_all(groupset.url, groupset.client_key))
        assert texts == reference
    finally:
        group.drain_and_stop(5)


def test_dep2_with_replicas_serves_the_tokens_of_one_process_through_live_rebalances(groupset, moe8_dir, reference):
    """Two replica slots over the DEP2 decode instance (10 physical experts for 8): its ranks load the replicas from
    the checkpoint, spread a hot expert's tokens over them, and move them live every few steps under 16 requests at
    once; every answer is the one process's, and no move fails."""
    group = groupset.up(dep_spec(moe8_dir, "dep2-replicas", redundant_experts=2))
    try:
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        assert asyncio.run(ask_all(groupset.url, groupset.client_key)) == reference
        decode_urls = sorted(e["url"] for g in groupset.admin.groups() if g["name"] == "dep2-replicas"
                             for e in g["endpoints"] if e["role"] == "decode")
        scraped = [scrape(u, groupset.backend.api_key) for u in decode_urls]
        moved = [sample_sum(s, "tideflow_expert_rebalances_total") for s in scraped]
        assert moved[0] >= 1 and moved[0] == moved[1], moved
        assert [sample_sum(s, "tideflow_expert_rebalance_failures_total") for s in scraped] == [0, 0]
        assert all(sample_sum(s, "tideflow_expert_computed_pairs_total") > 0 for s in scraped)  # each rank's load
    finally:
        group.drain_and_stop(5)


def test_surviving_rank_exits_when_its_peer_dies(moe8_dir, tideflow_home):
    """Atomicity from the inside: the rank left alone fails its next collective and exits non-zero."""
    dist_port = free_port()
    ports = [free_port(), free_port()]
    ranks = [Child(f"dep-rank-{r}", tideflow_argv(
        "serve", "--model", str(moe8_dir), "--port", str(ports[r]), "--kv-cache-bytes", "2000000",
        "--dep-rank", str(r), "--dep-size", "2", "--dist-addr", f"127.0.0.1:{dist_port}", "--dist-timeout-s", "20"),
        tideflow_home / "logs" / f"dep-rank-{r}.log", {"TIDEFLOW_API_KEYS": KEY}) for r in range(2)]
    try:
        for r in range(2):
            assert wait_http_ok(f"http://127.0.0.1:{ports[r]}/ready", 60, ranks[r], KEY), ranks[r].log_tail()
        ranks[1].kill(signal.SIGKILL)
        deadline = time.monotonic() + 40
        while ranks[0].alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ranks[0].returncode == EXIT_PEER_LOST, ranks[0].log_tail()
    finally:
        for child in ranks:
            child.stop(grace_s=2)


def test_sigkill_a_dep_rank_mid_stream_loses_nothing(groupset, moe8_dir):
    """A decode rank of a DEP2 instance is SIGKILLed while streams run on it: the whole group falls (its
    other rank exits with its peer), every request on it migrates to the colocated group and ends with the
    answer of an undisturbed run (greedy and seeded, streamed or not), with no client error."""
    from tests.engine.group.test_migration import PACED, check, migrations, workload

    plain = groupset.backend.member_args
    groupset.backend.member_args = lambda group, member, *a: plain(group, member, *a) + PACED
    dep = groupset.up(dep_spec(moe8_dir))
    backup = groupset.up(InferenceGroup.model_validate({
        "name": "backup", "version": "v1", "model": {"path": str(moe8_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 4_000_000, "max_wait_ms": 0}}]}))
    try:
        for g in (dep, backup):
            assert g.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, g.status.events
        want = asyncio.run(workload(groupset.url, groupset.client_key))
        assert not [a for a in want if isinstance(a, BaseException)], want
        groupset.admin.set_weights({"dep2": 4.0, "backup": 1.0})
        before = sum(migrations(groupset.url, groupset.client_key).values())
        held: list[int] = []

        def kill_rank1() -> None:
            held.append(groupset.admin.inflight("dep2"))
            pid = next(p for m, p in groupset.backend.pids(dep.status.handle).items() if m.role == "decode" and m.rank == 1)
            os.kill(pid, signal.SIGKILL)

        answers = asyncio.run(workload(groupset.url, groupset.client_key, kill_rank1))
        check(answers, want)
        moved = sum(migrations(groupset.url, groupset.client_key).values()) - before
        print(f"\nSIGKILL DEP rank 1 with {held[0]} requests on the group: {moved:.0f} migrated, exact answers")
        assert held[0] >= 1 and moved >= 1
    finally:
        groupset.backend.member_args = plain
        dep.drain_and_stop(5)
        backup.drain_and_stop(5)
