"""Request migration, the way users run it: router and members are separate processes, clients use the
official openai client, and a member is SIGKILLed while streams are half-way through. Every request must
complete with exactly the answer of an undisturbed run of the same requests (greedy and seeded), with
usage right, and no client error; the router's migration counter proves requests did move."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.group.manager import GroupState
from engine.runtime.process import tideflow_argv
from engine.telemetry.trace_cli import find_trace, read_spans
from tests.engine.group.conftest import group_spec

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

N = 14
MAX_TOKENS = 96
# Members pace their tokens (the fault injector's delay) so a stream lasts about 1.5 s: the kill lands while
# the router still streams, however far the client's event loop lags behind on a busy machine.
PACED = ["--faults", '{"token_delay_s": 0.015}']


@pytest.fixture(scope="module", autouse=True)
def paced_members(groupset):
    plain = groupset.backend.member_args
    groupset.backend.member_args = lambda group, member, *a: plain(group, member, *a) + PACED
    yield
    groupset.backend.member_args = plain


def request_args(i: int) -> tuple[str, dict]:
    """Request i of the workload: completions or chat, streamed or not, greedy or seeded."""
    api = "chat" if i % 4 in (2, 3) else "completions"
    args: dict = dict(model="default", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    args["temperature"] = 0.8 if i % 5 == 4 else 0
    if i % 5 == 4:
        args["seed"] = 1000 + i
    if i % 2:
        args.update(stream=True, stream_options={"include_usage": True})
    text = ("the pipeline " * (1 + i % 5)) + f"moves request {i}"
    if api == "chat":
        args["messages"] = [{"role": "user", "content": text}]
    else:
        args["prompt"] = text
    return api, args


async def one(client: openai.AsyncOpenAI, i: int, progress: list[int]) -> tuple[str, int, str | None]:
    """(text, completion tokens, finish reason) of request i; `progress[i]` counts the chunks seen so far."""
    api, args = request_args(i)
    create = client.chat.completions.create if api == "chat" else client.completions.create
    if not args.get("stream"):
        out = await create(**args)
        progress[i] = -1
        c = out.choices[0]
        return (c.message.content if api == "chat" else c.text), out.usage.completion_tokens, c.finish_reason
    parts, used, reason = [], None, None
    async for chunk in await create(**args):
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
        for c in chunk.choices:
            parts.append((c.delta.content or "") if api == "chat" else c.text)
            reason = c.finish_reason or reason
        progress[i] += 1
    return "".join(parts), used, reason


async def workload(url: str, key: str, when_streaming=None, chunks: int = 3) -> list:
    """All N requests at once; `when_streaming()` runs once every streamed request got `chunks` chunks."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
    progress = [0] * N
    try:
        tasks = [asyncio.create_task(one(client, i, progress)) for i in range(N)]
        if when_streaming is not None:
            streamed = [i for i in range(N) if request_args(i)[1].get("stream")]
            t0 = time.monotonic()
            while not all(progress[i] >= chunks for i in streamed):
                assert time.monotonic() - t0 < 60, f"streams did not start: {progress}"
                await asyncio.sleep(0.005)
            await asyncio.to_thread(when_streaming)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 240)
    finally:
        await client.close()


def router_sums(url: str, key: str, family_name: str, sample_suffix: str, label: str) -> dict[str, float]:
    """The router's `family_name` samples ending in `sample_suffix`, summed by `label`, from its /metrics."""
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}, trust_env=False, timeout=10).text
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            for s in family.samples:
                if s.name.endswith(sample_suffix):
                    sums[s.labels[label]] = sums.get(s.labels[label], 0) + s.value
    return sums


def migrations(url: str, key: str) -> dict[str, float]:
    """tideflow_router_migrations_total by reason."""
    return router_sums(url, key, "tideflow_router_migrations", "_total", "reason")


def migration_pauses(url: str, key: str) -> dict[str, float]:
    """How many moved streams tideflow_router_migration_seconds timed, by stage."""
    return router_sums(url, key, "tideflow_router_migration_seconds", "_count", "stage")


def ready(*groups) -> None:
    for g in groups:
        assert g.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY, g.status.events


def kill_busiest(groupset, groups: dict, role: str) -> tuple[str, int]:
    """SIGKILL the `role` member of the group holding the most in-flight requests (name, requests it held)."""
    held = {g["name"]: g["inflight"] for g in groupset.admin.groups() if g["name"] in groups}
    name = max(held, key=held.get)
    pid = next(pid for m, pid in groupset.backend.pids(groups[name].status.handle).items() if m.role == role)
    os.kill(pid, signal.SIGKILL)
    return name, held[name]


@pytest.fixture(scope="module")
def undisturbed(groupset, tiny_model_dir):
    """The workload's answers from two colocated groups with nothing killed: what every run must equal."""
    a = groupset.up(group_spec("mig-a", tiny_model_dir, colocated=True))
    b = groupset.up(group_spec("mig-b", tiny_model_dir, colocated=True))
    ready(a, b)
    answers = asyncio.run(workload(groupset.url, groupset.client_key))
    assert not [x for x in answers if isinstance(x, BaseException)], answers
    assert all(used == MAX_TOKENS and reason == "length" for _, used, reason in answers)
    return {"mig-a": a, "mig-b": b}, answers


def check(answers: list, want: list) -> None:
    errors = [(i, a) for i, a in enumerate(answers) if isinstance(a, BaseException)]
    assert not errors, f"client errors: {errors}"
    for i, (got, expected) in enumerate(zip(answers, want)):
        assert got == expected, f"request {i} ({request_args(i)[0]}, stream={bool(request_args(i)[1].get('stream'))})"


def test_sigkill_a_colocated_member_mid_stream_loses_nothing(groupset, undisturbed):
    groups, want = undisturbed
    before = sum(migrations(groupset.url, groupset.client_key).values())
    timed_before = migration_pauses(groupset.url, groupset.client_key)
    hit: list = []
    answers = asyncio.run(workload(groupset.url, groupset.client_key,
                                   lambda: hit.append(kill_busiest(groupset, groups, "colocated"))))
    check(answers, want)
    moved = sum(migrations(groupset.url, groupset.client_key).values()) - before
    (name, held), = hit
    assert held >= 1 and moved >= 1, f"nothing migrated: {name} held {held} requests at the kill"
    timed = migration_pauses(groupset.url, groupset.client_key)
    for stage in ("reopened", "first_token"):  # every moved stream's pause is timed, to each stage
        assert timed.get(stage, 0) - timed_before.get(stage, 0) == moved, (stage, timed, timed_before, moved)
    print(f"\nSIGKILL {name} holding {held} requests: {moved:.0f} migrated, {N} of {N} answers exact")
    ready(groups[name])  # rebuilt whole by its supervisor before the next test


def test_a_member_stopped_mid_stream_is_left_within_seconds_and_its_group_rebuilt(groupset, undisturbed):
    """SIGSTOP: the member's sockets stay open and nothing comes. The router used to wait out its 120 s read
    timeout; the streams' heartbeats stop with the process, so the router moves them after its 1.5 s stall
    timeout, and the supervisor, seeing the member unready for 3 s, rebuilds its group."""
    groups, want = undisturbed
    before = migrations(groupset.url, groupset.client_key).get("stall", 0)
    hit: list = []

    def stop_busiest() -> None:
        held = {g["name"]: g["inflight"] for g in groupset.admin.groups() if g["name"] in groups}
        name = max(held, key=held.get)
        handle = groups[name].status.handle
        pid = next(pid for m, pid in groupset.backend.pids(handle).items() if m.role == "colocated")
        os.kill(pid, signal.SIGSTOP)
        hit.append((name, held[name], handle))

    t0 = time.monotonic()
    answers = asyncio.run(workload(groupset.url, groupset.client_key, stop_busiest))
    took = time.monotonic() - t0
    check(answers, want)
    (name, held, handle), = hit
    stalled = migrations(groupset.url, groupset.client_key).get("stall", 0) - before
    assert held >= 1 and stalled >= 1, f"nothing moved for a stall: {name} held {held} requests"
    assert took < 60, f"the workload took {took:.0f}s: the stopped member was waited for"  # the read timeout is 120 s
    deadline = time.monotonic() + 60
    while groups[name].status.handle in (handle, None) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert groups[name].status.handle not in (handle, None), "the stopped member's group was not rebuilt"
    ready(groups[name])
    assert "not Ready for" in " ".join(e.message for e in groups[name].status.events)
    print(f"\nSIGSTOP {name} holding {held} requests: {stalled:.0f} moved for a stall, answers exact, {took:.1f}s")


def one_streamed_id(url: str, key: str) -> str:
    """The id of one streamed completion through the router (what a client quotes to `tideflow trace`)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    try:
        chunks = list(client.completions.create(model="default", prompt="trace this request", max_tokens=8,
                                                temperature=0, stream=True))
    finally:
        client.close()
    return chunks[0].id


def spans_until(home: Path, enough, timeout_s: float = 20.0) -> list[dict]:
    """The span files' spans once `enough(spans)` holds (spans reach the files about a second after they end), or
    as they are at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = read_spans(home / "traces")
        if enough(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


CROSSING = {("router", "POST /v1/completions"), ("router", "prefill /internal/prefill"),
            ("router", "decode /internal/decode"), ("prefill", "POST /internal/prefill"),
            ("prefill", "engine.prefill"), ("prefill", "engine.kv_export"), ("decode", "POST /internal/decode"),
            ("decode", "kv.pull"), ("decode", "engine.kv_import"), ("decode", "engine.decode")}


def check_crossing(home: Path, request_id: str) -> None:
    """The request's one trace crosses the router, prefill and decode processes (each member's span parented by the
    router's call), with the engines' phases; `tideflow trace` prints its timeline. Read before anything is killed:
    a member SIGKILLed before its spans were written takes them along."""
    def names(spans: list[dict]) -> set:
        trace_id = find_trace(spans, request_id)
        return {(s["service"], s["name"]) for s in spans if s["trace_id"] == trace_id}

    spans = spans_until(home, lambda found: CROSSING <= names(found))
    trace_id = find_trace(spans, request_id)
    assert trace_id is not None, f"no span names {request_id}"
    assert CROSSING <= names(spans), sorted(CROSSING - names(spans))
    mine = {s["span_id"]: s for s in spans if s["trace_id"] == trace_id}
    crossed = [s for s in mine.values() if s["service"] in ("prefill", "decode") and s["kind"] == "server"]
    assert all(mine.get(s["parent_id"], {}).get("service") == "router" for s in crossed), "a member span lost its parent"
    shown = subprocess.run(tideflow_argv("trace", request_id), capture_output=True, text=True, timeout=60,
                           env={**os.environ, "TIDEFLOW_HOME": str(home)})
    assert shown.returncode == 0, shown.stderr
    assert trace_id in shown.stdout and "engine.prefill" in shown.stdout and "kv.pull" in shown.stdout, shown.stdout


def check_links(home: Path) -> None:
    """A migrated stream: the router's call that resumed it links the call that broke (same trace, error status),
    and the two calls went to different members."""
    def moved(spans: list[dict]) -> list[tuple[dict, dict]]:
        by_id = {s["span_id"]: s for s in spans}
        return [(s, by_id[link["span_id"]]) for s in spans for link in s["links"]
                if link["span_id"] in by_id and link["trace_id"] == s["trace_id"]]

    links = moved(spans_until(home, moved))
    assert links, "no migrated stream links the stream that broke"
    for resumed, broken in links:
        assert broken["status"] == "error" and broken["service"] == resumed["service"] == "router"
        assert broken["attributes"]["server.address"] != resumed["attributes"]["server.address"], (broken, resumed)


@pytest.mark.parametrize("role,chunks", [("decode", 3), ("prefill", 0), ("prefill", 3)],
                         ids=["decode", "prefill-before-handoff", "prefill-after-handoff"])
def test_sigkill_a_pd_member_mid_stream_loses_nothing(groupset, undisturbed, tiny_model_dir, tideflow_home, role,
                                                      chunks):
    """Decode killed: its streams resume through prefill + decode of another group (or its rebuild).
    Prefill killed as the requests arrive (chunks=0: the kill lands while prompts are being prefilled):
    they are retried on the other prefill instance, nothing having reached the client; killed later,
    the streams past their KV handoff go on from decode. Either way, the answers of the undisturbed run."""
    groups, want = undisturbed
    pd = groupset.up(group_spec(f"mig-pd-{role}-{chunks}", tiny_model_dir, prefill=2))
    try:
        ready(pd)
        if role == "decode":  # one request the PD group alone serves: its trace crosses router, prefill and decode
            groupset.admin.set_weights({"mig-a": 0.0, "mig-b": 0.0, pd.spec.name: 1.0})
            check_crossing(tideflow_home, one_streamed_id(groupset.url, groupset.client_key))
        groupset.admin.set_weights({"mig-a": 0.0, "mig-b": 1.0, pd.spec.name: 3.0})
        before = sum(migrations(groupset.url, groupset.client_key).values())
        hit: list = []

        def kill() -> None:
            t0 = time.monotonic()
            while groupset.admin.inflight(pd.spec.name) == 0:  # chunks=0: the requests are only arriving
                assert time.monotonic() - t0 < 60, "no request reached the PD group"
            hit.append(kill_busiest(groupset, {pd.spec.name: pd}, role))

        answers = asyncio.run(workload(groupset.url, groupset.client_key, kill, chunks))
        check(answers, want)
        moved = sum(migrations(groupset.url, groupset.client_key).values()) - before
        print(f"\nSIGKILL {role} of {pd.spec.name} holding {hit[0][1]} requests: {moved:.0f} migrated, exact answers")
        if role == "decode":
            assert hit[0][1] >= 1 and moved >= 1
            check_links(tideflow_home)
    finally:
        pd.drain_and_stop(5)
        groupset.admin.set_weights({"mig-a": 1.0, "mig-b": 1.0})


@pytest.mark.parametrize("role,chunks", [("prefill", 0), ("decode", 3)], ids=["prefill-while-prefilling", "decode"])
def test_a_pd_member_stopped_mid_request_is_left_within_seconds(groupset, undisturbed, tiny_model_dir, role, chunks):
    """SIGSTOP on a PD group: a stopped prefill member's answer (a JSON body the member paces with spaces) goes
    silent, so the router tries the other prefill instance after its stall timeout instead of its 120 s read
    timeout; a stopped decode member's streams move as a colocated one's do."""
    groups, want = undisturbed
    pd = groupset.up(group_spec(f"stop-pd-{role}", tiny_model_dir, prefill=2))
    try:
        ready(pd)
        groupset.admin.set_weights({"mig-a": 0.0, "mig-b": 1.0, pd.spec.name: 3.0})
        hit: list = []

        def stop() -> None:
            t0 = time.monotonic()
            while groupset.admin.inflight(pd.spec.name) == 0:  # chunks=0: the requests are only arriving
                assert time.monotonic() - t0 < 60, "no request reached the PD group"
            pid = next(pid for m, pid in groupset.backend.pids(pd.status.handle).items() if m.role == role)
            os.kill(pid, signal.SIGSTOP)
            hit.append(pid)

        t0 = time.monotonic()
        answers = asyncio.run(workload(groupset.url, groupset.client_key, stop, chunks))
        took = time.monotonic() - t0
        check(answers, want)
        assert hit and took < 60, f"the workload took {took:.0f}s: the stopped {role} member was waited for"
        print(f"\nSIGSTOP {role} of {pd.spec.name}: answers exact, {took:.1f}s")
    finally:
        pd.drain_and_stop(5)
        groupset.admin.set_weights({"mig-a": 1.0, "mig-b": 1.0})
