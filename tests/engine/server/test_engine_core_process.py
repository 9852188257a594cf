"""`tideflow serve --engine-core process`: the engine core in a process of its own behind API server processes,
as an operator starts it. Answers equal the in-process engine's (greedy, seeded, stop strings, resume); a
stop string and a dead API server free the core's requests; a dead core ends every stream, turns /ready
false within a second and takes the member down."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.core.engine_config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.runtime.errors import EXIT_ENGINE_FAILED
from engine.model.loader import load_model
from engine.runtime.process import Child, free_port, start_ticks, tideflow_argv, wait_http_ok
from engine.model.tokenizer import Tokenizer

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

KEY = "core-key"
KV_BYTES = 16 << 20


def children_of(pid: int, marker: str) -> list[int]:
    """Live processes whose parent is `pid` and whose command line holds `marker`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == pid and marker in cmdline and start_ticks(int(stat.parent.name)) is not None:
            found.append(int(stat.parent.name))
    return found


def start_member(model_dir: Path, log_path: Path, *flags: str) -> tuple[Child, str]:
    port = free_port()
    argv = tideflow_argv("serve", "--model", str(model_dir), "--port", str(port), "--kv-cache-bytes", str(KV_BYTES),
                         "--max-wait-ms", "1", "--engine-core", "process", *flags)
    child = Child("serve-core-process", argv, log_path, {"TIDEFLOW_API_KEYS": KEY})
    url = f"http://127.0.0.1:{port}"
    if not wait_http_ok(url + "/ready", 120, child, KEY):
        child.stop()
        raise RuntimeError(f"serve --engine-core process did not become ready: {child.log_tail()}")
    return child, url


def core_spec(core_pid: int) -> dict:
    """The CoreSpec a member handed its engine core on the command line."""
    return json.loads(Path(f"/proc/{core_pid}/cmdline").read_bytes().split(b"\0")[3])


@pytest.fixture(scope="module")
def member(tiny_model_dir, tmp_path_factory):
    """A member with two API servers; stopped as a supervisor stops it, it must leave no socket folder (its
    shutdown may outlast the supervisor's grace: the core, stopped or orphaned, removes the folder first)."""
    child, url = start_member(tiny_model_dir, tmp_path_factory.mktemp("core-process") / "serve.log",
                              "--api-server-count", "2")
    sockets = Path(core_spec(children_of(child.pid, "engine.core.core_process")[0])["socket_dir"])
    try:
        yield child, url
    finally:
        child.stop()
    deadline = time.monotonic() + 20
    while sockets.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sockets.exists(), "the stopped member left its socket folder behind"


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The same model in this process, text made on its engine thread: what the split member must answer."""
    engine = LLMEngine(load_model(tiny_model_dir), Tokenizer(tiny_model_dir), EngineConfig(kv_cache_bytes=KV_BYTES))
    engine.start()
    yield engine
    engine.stop()


def stats(url: str) -> dict:
    return httpx.get(url + "/internal/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


def settle(url: str, timeout_s: float = 10.0) -> dict:
    """The core's load once nothing runs or waits (requests aborted by a stop string or a dead API server)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = stats(url)
        if (now["running"] == 0 and now["queued"] == 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_answers_equal_the_in_process_engine(member, reference, tiny_model_dir):
    _, url = member
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = tiny_model_dir.name
    prompts = ["hello world", "the quick brown fox", "tideflow serves"]
    greedy = reference.generate([reference.tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=12))
    for prompt, want in zip(prompts, greedy):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    # A stop string cut from the greedy text itself: the answer ends where it begins, as in-process.
    stop = greedy[1].text[4:6]
    assert stop.strip(), greedy[1].text
    want = reference.generate([reference.tokenizer.encode(prompts[1])], SamplingParams(max_tokens=12, stop=[stop]))[0]
    got = client.completions.create(model=model, prompt=prompts[1], max_tokens=12, temperature=0, stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")
    assert stop not in got.choices[0].text
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11)
    want = reference.generate([reference.tokenizer.encode(prompts[2])], seeded)[0]
    got = client.completions.create(model=model, prompt=prompts[2], max_tokens=10, temperature=0.9, top_p=0.9, seed=11)
    assert got.choices[0].text == want.text


def test_a_resumed_request_goes_on_as_the_first_worker_would(member, reference, tiny_model_dir):
    _, url = member
    prompt = reference.tokenizer.encode("resume me please")
    whole = reference.generate([prompt], SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True))[0]
    assert len(whole.token_ids) == 10
    body = {"api": "completions", "prompt_token_ids": prompt,
            "request": {"model": tiny_model_dir.name, "prompt": prompt, "max_tokens": 10, "temperature": 0.8,
                        "ignore_eos": True},
            "resume": {"output_token_ids": whole.token_ids[:4], "sent_chars": 0, "seed": 5}}  # a seeded request's seed
    answer = httpx.post(url + "/internal/resume", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == whole.text


def test_a_stop_string_ends_the_request_in_the_core_too(member, reference, tiny_model_dir):
    _, url = member
    free_before = settle(url)["kv_blocks_free"]
    text = reference.generate([reference.tokenizer.encode("stop early")],
                              SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    stop = text[2:4]
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    got = client.completions.create(model=tiny_model_dir.name, prompt="stop early", max_tokens=2000, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens < 10
    after = settle(url)
    assert (after["running"], after["kv_blocks_free"]) == (0, free_before)  # not 2,000 tokens left running


def test_logprobs_and_a_bias_cross_the_core_as_the_engine_made_them(member, reference, tiny_model_dir):
    _, url = member
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    prompt = reference.tokenizer.encode("the tide rises")
    want = reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3,
                                                       logit_bias={100: 6.0}))[0]
    expected = want.logprobs
    got = client.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=3,
                                    logit_bias={"100": 6}, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.text and len(lp.token_logprobs) == len(expected) == 8
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-4)
    for top, e in zip(lp.top_logprobs, expected):  # text -> value: two ids of one text keep the likelier
        assert max(top.values()) == pytest.approx(e.top[0][1], abs=1e-4)
        assert all(any(abs(v - w) < 1e-4 for _, w in e.top) for v in top.values())
    early = reference.tokenizer.encode("stop early")  # a stop string ends the request in the API server
    stop = reference.generate([early], SamplingParams(max_tokens=8, ignore_eos=True))[0].text[2:4]
    cut = client.completions.create(model=tiny_model_dir.name, prompt=early, max_tokens=8, temperature=0, logprobs=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert len(cut.choices[0].logprobs.tokens) == cut.usage.completion_tokens < 8


# An API server process that submits one long request to a member's core, says so, and waits to be killed.
API_SERVER_THAT_DIES = """
import asyncio, sys
from pathlib import Path
from engine.core.sampling_params import SamplingParams
from engine.server.core_client import CoreClient
from engine.model.tokenizer import Tokenizer
client = CoreClient(sys.argv[1], Tokenizer(sys.argv[2]), Path(sys.argv[3]), connect_timeout_s=30)
async def main():
    stream = client.stream([5, 6, 7], SamplingParams(max_tokens=3000, ignore_eos=True))
    async for out in stream:
        if out.token_ids:
            print("streaming", flush=True)
            await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_the_core_aborts_the_requests_of_an_api_server_that_died(member, tiny_model_dir, tmp_path):
    child, url = member
    core_pid = children_of(child.pid, "engine.core.core_process")[0]
    spec = core_spec(core_pid)
    socket_dir = spec["input_address"].removeprefix("ipc://").rsplit("/", 1)[0]
    free_before = settle(url)["kv_blocks_free"]
    doomed = subprocess.Popen([sys.executable, "-c", API_SERVER_THAT_DIES, spec["input_address"], str(tiny_model_dir),
                               socket_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert doomed.stdout.readline().strip() == "streaming"
        deadline = time.monotonic() + 5  # each API server reads the core's load from its heartbeat (every 0.2 s)
        while stats(url)["running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats(url)["running"] == 1
        doomed.kill()
        doomed.wait(timeout=10)
        after = settle(url, timeout_s=15)
        assert (after["running"], after["kv_blocks_free"]) == (0, free_before)
    finally:
        doomed.kill()
        doomed.wait(timeout=10)
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    assert 'status="aborted"' in metrics


def test_a_killed_api_server_is_started_again(member):
    child, url = member
    [extra] = children_of(child.pid, "engine.server.api_servers")
    dead = start_ticks(extra)
    subprocess.run(["kill", "-9", str(extra)], check=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        again = children_of(child.pid, "engine.server.api_servers")
        if again and again != [extra] or (again == [extra] and start_ticks(extra) != dead):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the API server was not started again")
    assert wait_http_ok(url + "/ready", 30, child, KEY)


def test_a_dead_core_ends_every_stream_and_the_member(tiny_model_dir, tmp_path):
    child, url = start_member(tiny_model_dir, tmp_path / "serve.log", "--api-server-count", "2")
    try:
        [core_pid] = children_of(child.pid, "engine.core.core_process")
        sockets = Path(core_spec(core_pid)["socket_dir"])
        assert sockets.is_dir()
        extras = children_of(child.pid, "engine.server.api_servers")
        body = {"model": tiny_model_dir.name, "prompt": "a long answer", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
            with http.stream("POST", url + "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                subprocess.run(["kill", "-9", str(core_pid)], check=True)
                killed = time.monotonic()
                rest: list[str] = []
                try:
                    rest = [line for line in lines if line.startswith("data:")]
                except httpx.HTTPError:  # the connection closed by the member's exit: an end too
                    rest = ["closed"]
                assert time.monotonic() - killed < 10
                assert rest[-1] == "closed" or any('"error"' in line for line in rest), rest[-3:]
        assert not _ready(url)  # within a second of the kill: 503, or nobody listening
        assert time.monotonic() - killed < 1.5
        assert child.proc.wait(timeout=20) == EXIT_ENGINE_FAILED
        deadline = time.monotonic() + 15
        while any(start_ticks(pid) is not None for pid in extras) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(start_ticks(pid) is None for pid in extras), "an API server outlived its core"
        assert "the engine core exited" in child.log_path.read_text()
        assert not sockets.exists(), "the member left its socket folder behind"
    finally:
        child.stop()


def test_a_killed_member_leaves_no_socket_folder(tiny_model_dir, tmp_path):
    """SIGKILL runs no cleanup in the member: its core, told by the kernel, removes the folder on its way out."""
    child, url = start_member(tiny_model_dir, tmp_path / "serve.log")
    try:
        [core_pid] = children_of(child.pid, "engine.core.core_process")
        sockets = Path(core_spec(core_pid)["socket_dir"])
        assert sockets.is_dir()
        child.proc.kill()
        child.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while start_ticks(core_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert start_ticks(core_pid) is None, "the core outlived its member"
        assert not sockets.exists(), "the socket folder outlived the member"
    finally:
        child.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("flags, words", [
    (["--role", "prefill"], "colocated role only"),
    (["--dep-size", "2"], "DEP"),
    (["--engine-core", "thread", "--api-server-count", "2"], "needs --engine-core process"),
    (["--standby", "--api-server-count", "2"], "one API server"),
])
def test_flags_it_cannot_serve_are_refused(tiny_model_dir, flags, words):
    argv = tideflow_argv("serve", "--model", str(tiny_model_dir), "--engine-core", "process", *flags)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr
