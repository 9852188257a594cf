"""A member tells busy from stuck: while its engine is at work (a long prompt included) a stream to the router
carries a heartbeat every half second; once one step runs far past what its steps take, the heartbeats stop
and /ready answers 503, so the router (stall timeout) and the controller (unready_s) act within seconds."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from engine.core import step_clock
from engine.core.llm_engine import EngineConfig
from engine.core.resume import TRACE_HEADER
from engine.core.step_clock import StepClock
from tests.engine.server.conftest import API_KEY, MODEL, serve

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_step_s_budget_follows_its_tokens_and_the_recent_steps(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(step_clock, "time", clock)
    steps = StepClock()
    for _ in range(5):  # 128-token prompts at 1 ms a token, 10 ms decodes
        steps.begin(128)
        clock.now += 0.128
        steps.end()
        steps.begin(4)
        clock.now += 0.010
        steps.end()
    steps.begin(4)  # a decode: its budget is the recent steps' (4 x ~0.128 s)
    assert steps.live()
    clock.now += 0.4
    assert steps.live()
    clock.now += 0.4
    assert not steps.live()  # 0.8 s into a step whose like took 0.13 s: stuck
    steps.end()
    steps.begin(2048)  # a long chunk: 2,048 tokens at ~1 ms each, x4
    clock.now += 6.0
    assert steps.live()
    clock.now += 3.0
    assert not steps.live()
    steps.end()
    steps.begin()  # a pass that plans nothing teaches nothing: the budget stays what the steps taught
    clock.now += 0.5
    steps.end(record=False)
    assert steps.recent_s > 2.0 and steps.steps == 12


@pytest.fixture
def member(tiny_model_dir):
    with serve(tiny_model_dir, EngineConfig(kv_cache_bytes=64 << 20, max_wait_ms=0, max_batch_tokens=512)) as s:
        yield s


def stream_lines(member, body: dict, lines: list[tuple[float, str]]) -> None:
    with httpx.Client(base_url=member.url, headers={"Authorization": f"Bearer {API_KEY}", TRACE_HEADER: "1"},
                      timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append((time.monotonic(), line))


def slow_step(member, seconds: float, when) -> threading.Event:
    """The engine's model step takes `seconds` longer once, at the first step `when(step)` picks."""
    runner, done = member.engine.runner, threading.Event()
    step = runner.step

    def slowed(seqs):
        if not done.is_set() and when(seqs):
            done.set()
            time.sleep(seconds)
        return step(seqs)

    runner.step = slowed
    return done


def longest_silence(lines: list[tuple[float, str]], start: float) -> float:
    times = [start] + [t for t, _ in lines]
    return max(b - a for a, b in zip(times, times[1:]))


def test_a_long_prompt_beats_while_it_is_computed(member):
    """A 2 s prefill step (a long prompt on a slow host): its tokens' budget covers it, so the stream beats."""
    slow_step(member, 2.0, lambda seqs: sum(len(s.tokens) for s in seqs) >= 100)
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    stream_lines(member, {"model": MODEL, "prompt": list(range(3, 203)), "max_tokens": 3, "stream": True}, lines)
    beats = [line for _, line in lines if line.startswith(":")]
    assert len(beats) >= 3, lines
    assert longest_silence(lines, t0) < 1.0
    assert lines[-1][1] == "data: [DONE]"


def test_a_stuck_step_stops_the_beats_and_fails_ready(member):
    """A decode step that runs 4 s where the steps before took milliseconds: after its budget the stream goes
    silent (the router's stall timeout takes it from there) and /ready answers 503."""
    prompt = list(range(3, 40))
    for _ in range(3):  # steps of this size teach the clock what they take
        stream_lines(member, {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}, [])
    stuck = slow_step(member, 4.0, lambda seqs: all(len(s.tokens) == 1 for s in seqs))
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=stream_lines, args=(member, {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                                 "stream": True}, lines))
    t0 = time.monotonic()
    reader.start()
    assert stuck.wait(10)
    time.sleep(1.0)
    with member.client() as c:
        ready = c.get("/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_stuck", ready.text
    reader.join(30)
    assert longest_silence(lines, t0) >= 3.0  # no heartbeat while stuck
    with member.client() as c:
        assert c.get("/ready").status_code == 200  # the step ended: live again
