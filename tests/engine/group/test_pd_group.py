"""PD groups through the router: same output as the colocated engine, atomic rebuilds, clean failure."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.offline.generate import generate
from engine.group.backend import Phase
from engine.group.manager import GroupState
from engine.model.loader import load_model
from engine.core.engine_config import EngineConfig
from engine.core.kv_cache import kv_nbytes
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.model.tokenizer import ChatMessage, Tokenizer

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

PROMPTS = [("the pipeline " * (1 + i % 7)) + f"request {i}" for i in range(32)]
MAX_TOKENS = [4 + (i * 5) % 20 for i in range(32)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model, tok = load_model(tiny_model_dir), Tokenizer(tiny_model_dir)
    outs = generate(model, tok, [tok.encode(p) for p in PROMPTS],
                    [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return [o.text for o in outs]


async def complete_all(url: str, key: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)

    async def one(i: int) -> str:
        args = dict(model="default", prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0,
                    extra_body={"ignore_eos": True})
        if i % 2:
            stream = await client.completions.create(stream=True, **args)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return (await client.completions.create(**args)).choices[0].text

    try:
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    finally:
        await client.close()


@pytest.mark.parametrize("prefill,transfer", [(1, "shm"), (2, "tcp")])
def test_pd_group_matches_colocated_output(groupset, make_spec, reference, prefill, transfer):
    group = groupset.up(make_spec(f"pd-{prefill}p1d", prefill=prefill, transfer=transfer))
    try:
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        texts = asyncio.run(complete_all(groupset.url, groupset.client_key))
        assert texts == reference
    finally:
        group.drain_and_stop(5)


async def stream_until_end(client, i: int) -> str:
    """'ok' for a full answer, 'error' when the stream ended with an error; never hangs (bounded)."""
    try:
        stream = await client.completions.create(model="default", prompt=PROMPTS[i], max_tokens=48, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        n = 0
        async for chunk in stream:
            n += bool(chunk.choices and chunk.choices[0].text)
        return "ok" if n else "error"
    except openai.APIError:
        return "error"


def test_sigkill_member_rebuilds_group_and_loses_no_request(groupset, make_spec):
    pd = groupset.up(make_spec("pd-victim"))
    other = groupset.up(make_spec("other", colocated=True))
    try:
        for g in (pd, other):
            assert g.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, g.status.events
        before = groupset.backend.pids(pd.status.handle)
        decode_pid = next(pid for m, pid in before.items() if m.role == "decode")

        async def drill() -> tuple[list[str], float]:
            client = openai.AsyncOpenAI(base_url=groupset.url + "/v1", api_key=groupset.client_key, max_retries=0,
                                        timeout=60)
            tasks = [asyncio.create_task(stream_until_end(client, i)) for i in range(20)]
            await asyncio.sleep(0.5)
            os.kill(decode_pid, signal.SIGKILL)
            killed = time.monotonic()
            while any(g["name"] == "pd-victim" and g["routable"] for g in groupset.admin.groups()):
                assert time.monotonic() - killed < 60, "the group stayed routable with a dead member"
                await asyncio.sleep(0.01)
            ejected = time.monotonic() - killed  # a figure to print, not to assert: no timing asserts in tests
            outcomes = await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)
            await client.close()
            return outcomes, ejected

        t0 = time.monotonic()
        outcomes, ejected_s = asyncio.run(drill())
        assert len(outcomes) == 20 and outcomes.count("ok") + outcomes.count("error") == 20
        assert pd.wait_for({GroupState.STARTING}, 10) in (GroupState.STARTING, GroupState.READY)
        assert pd.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY
        rebuilt_s = time.monotonic() - t0
        after = groupset.backend.pids(pd.status.handle)
        assert set(after.values()).isdisjoint(before.values()), "every member of the rebuilt group is new"
        print(f"\nSIGKILL decode: out of the router in {ejected_s * 1000:.0f} ms, group Ready again after "
              f"{rebuilt_s:.1f}s; outcomes ok={outcomes.count('ok')} error={outcomes.count('error')}")
    finally:
        pd.drain_and_stop(5)
        other.drain_and_stop(5)


def _alive_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (proc / "stat").read_text().split()[2]
            except OSError:
                continue
            if marker in cmdline and state != "Z":
                pids.append(int(proc.name))
    return pids


def test_member_that_cannot_start_fails_group_and_reaps_the_rest(groupset, make_spec):
    # The decode member's KV budget is below one block: it exits at start while prefill comes up.
    spec = make_spec("broken", decode_kv_bytes=1)
    group = groupset.up(spec)
    try:
        assert group.wait_for({GroupState.FAILED}, 120) == GroupState.FAILED
        assert group.status.restarts == groupset.manager.policy.max_restarts
        last = group.status.events[-1].message
        assert "decode instance 0 rank 0 Failed" in last and "below one block" in last
        assert not _alive_with("--metrics-group broken "), "no member of the failed group is left running"
        assert all(m.phase in (Phase.FAILED, Phase.EXITED, Phase.READY, Phase.RUNNING) for m in group.status.members)
    finally:
        group.drain_and_stop(1)


def test_logprobs_and_a_bias_cross_prefill_to_decode(groupset, make_spec, tiny_model_dir):
    """The first token is drawn on prefill and reported by decode: its log-probabilities travel with the handoff."""
    model, tok = load_model(tiny_model_dir), Tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "the pipeline request"}]
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_bytes=16 << 20))
    engine.start()
    try:  # the colocated engine's answer to the same prompt
        prompt = tok.encode(tok.apply_chat_template([ChatMessage.model_validate(m) for m in messages]))
        want = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2,
                                                        logit_bias={100: 3.0}))[0]
    finally:
        engine.stop()
    group = groupset.up(make_spec("pd-logprobs", prefill=1, transfer="shm"))
    try:
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        client = openai.OpenAI(base_url=groupset.url + "/v1", api_key=groupset.client_key, max_retries=0, timeout=120)
        args = dict(model="default", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                    logit_bias={"100": 3}, extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**args).choices[0].logprobs.content
        streamed = [e for c in client.chat.completions.create(stream=True, **args)
                    if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        for got in (whole, streamed):
            assert [e.bytes for e in got] == [list(tok.token_bytes(t)) for t in want.token_ids]
            assert [e.logprob for e in got] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
            assert [[t.bytes for t in e.top_logprobs] for e in got] == [
                [list(tok.token_bytes(t)) for t, _ in lp.top] for lp in want.logprobs]
    finally:
        group.drain_and_stop(5)


def test_a_decode_member_holding_the_prefix_is_sent_only_the_blocks_it_lacks(groupset, make_spec, tiny_model_dir):
    """Turns of one conversation through router, prefill and decode processes: once the router has read from the
    decode member's KV feed that it holds the conversation so far, prefill sends it only the new blocks. Every answer
    is the colocated engine's, and the decode member pulls fewer bytes per turn than the prompt's whole KV."""
    model, tok = load_model(tiny_model_dir), Tokenizer(tiny_model_dir)
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_bytes=16 << 20))
    engine.start()
    group = groupset.up(make_spec("pd-prefix", prefill=1, transfer="tcp"))
    try:
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, group.status.events
        decode_url = next(m.endpoint for m in group.status.members if m.role == "decode")
        client = openai.OpenAI(base_url=groupset.url + "/v1", api_key=groupset.client_key, max_retries=0, timeout=60)
        conversation = [(5 * i) % 400 + 3 for i in range(8 * 16)]  # 8 blocks of the engine's default 16 tokens
        deadline, turns, whole_blocks = time.monotonic() + 60, 0, 0
        while _decode_metric(decode_url, groupset.member_key, "tideflow_kv_transfer_skipped_blocks_total") == 0:
            assert time.monotonic() < deadline, "the decode member was sent every block of every turn"
            conversation += [(7 * turns + j) % 400 + 3 for j in range(5)]
            whole_blocks += -(-len(conversation) // engine.config.block_size)
            want = engine.generate([conversation], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
            got = client.completions.create(model="default", prompt=conversation, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
            assert got == tok.decode(want)
            conversation += want
            turns += 1
        pulled = _decode_metric(decode_url, groupset.member_key, "tideflow_kv_transfer_bytes_total")
        assert pulled < kv_nbytes(engine.runner.kv_cache, whole_blocks), "no fewer bytes than every turn's whole KV"
        assert _decode_metric(decode_url, groupset.member_key, "tideflow_kv_transfer_recomputes_total") == 0
    finally:
        group.drain_and_stop(5)
        engine.stop()


def _decode_metric(url: str, key: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}, trust_env=False, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
