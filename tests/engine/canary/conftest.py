"""A real group set for canary tests: router, a stable group, canaries (some with injected faults), Prometheus."""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field

import openai
import pytest

from harness.prometheus import LocalPrometheus, groupset_jobs
from engine.api.fault_config import FaultConfig
from engine.group.groupset import GroupSetConfig, LocalGroupSet
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup

# name -> (version, faults); "bad" fails half its requests, "slow" waits 300 ms before every output.
GROUPS = {
    "stable": ("v1", None),
    "good": ("v2", None),
    "bad": ("v2-errors", FaultConfig(error_rate=0.5, seed=1)),
    "slow": ("v2-slow", FaultConfig(token_delay_s=0.3)),
}


@dataclass
class Fleet:
    gs: LocalGroupSet
    prometheus: LocalPrometheus

    def only(self, **weights: float) -> None:
        """Set these weights and every other registered group's to 0."""
        self.gs.admin.set_weights({g["name"]: weights.get(g["name"], 0.0) for g in self.gs.admin.groups()})


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDEFLOW_HOME", str(tmp_path_factory.mktemp("tideflow-home")))
        gs = LocalGroupSet(GroupSetConfig(model_dir=tiny_model_dir))
        try:
            groups = [gs.up(_spec(name, version, faults, tiny_model_dir)) for name, (version, faults) in GROUPS.items()]
            for g in groups:
                state = g.wait_for({GroupState.READY, GroupState.FAILED}, 180)
                assert state == GroupState.READY, [e.message for e in g.status.events]
            with LocalPrometheus(groupset_jobs(gs), tmp_path_factory.mktemp("prometheus")) as prometheus:
                yield Fleet(gs, prometheus)
        finally:
            gs.close(drain_s=1.0)


def _spec(name: str, version: str, faults: FaultConfig | None, model_dir) -> InferenceGroup:
    engine = {"kv_cache_bytes": 8_000_000, "faults": None if faults is None else faults.model_dump()}
    return InferenceGroup.model_validate({
        "name": name, "version": version, "model": {"path": str(model_dir)},
        "roles": [{"role": "colocated", "instances": 1, "engine": engine}]})


@dataclass
class Load:
    """Completions through the router from a background thread (asyncio + AsyncOpenAI), until stopped
    or `limit` requests were sent; every request ends counted as ok or as error (with its message)."""

    url: str
    key: str
    concurrency: int = 6
    limit: int = 20_000
    sent: int = 0
    ok: int = 0
    error: int = 0
    messages: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._rng = random.Random(0)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "load did not finish"

    def wait(self) -> None:
        self._thread.join(timeout=60)

    async def _main(self) -> None:
        async with openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0, timeout=30) as client:
            await asyncio.gather(*(self._worker(client) for _ in range(self.concurrency)))

    async def _worker(self, client: openai.AsyncOpenAI) -> None:
        while not self._stop.is_set() and self.sent < self.limit:
            n = self.sent
            self.sent += 1
            try:
                if self._rng.random() < 0.25:  # random, not every 4th: the router's round robin would alias with it
                    r = await client.completions.create(model="default", prompt=f"request {n}", max_tokens=8, temperature=0)
                    assert r.choices[0].finish_reason in ("stop", "length")
                else:
                    stream = await client.completions.create(model="default", prompt=f"request {n}", max_tokens=8,
                                                             temperature=0, stream=True)
                    reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
                    assert reasons and reasons[-1] in ("stop", "length"), reasons
                self.ok += 1
            except Exception as exc:  # every failure is counted with its reason; none may be silent
                self.error += 1
                self.messages.append(f"{type(exc).__name__}: {exc}")


@pytest.fixture
def load(fleet):
    return lambda **kw: Load(fleet.gs.url, fleet.gs.client_key, **kw)
