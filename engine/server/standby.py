"""The serving switch of one engine: serving <-> standby (silent: loaded, warm, KV released).

A standby engine keeps its weights and built kernels and frees its KV cache, so it costs little
on the device; activation is one KV allocation plus a readiness flip. Parking stops admitting
(new requests get 503), waits for open requests to finish, and only then releases the KV, so
no request is ever cut off: if they do not finish in time, the engine goes back to serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import Enum

from pydantic import BaseModel, Field

from engine.runtime.errors import TideflowError
from engine.core.llm_engine import LLMEngine

log = logging.getLogger(__name__)

WARM_UP_BLOCKS = 4  # a few blocks carry the warm-up generation of a standby start


class InstanceState(str, Enum):
    LOADING = "loading"  # loading weights or warming up
    SERVING = "serving"
    STANDBY = "standby"
    PARKING = "parking"  # refusing new requests, draining open ones


class SwitchError(TideflowError):
    """The switch cannot go where it was asked; `status` is the HTTP status the admin route answers."""

    status = 409


class SwitchReport(BaseModel):
    """What one activate or park call did."""

    state: InstanceState = Field(description="state after the call")
    seconds: float = Field(ge=0, description="wall time the transition took")
    kv_blocks: int = Field(ge=0, description="KV blocks allocated after the call")
    drained: int = Field(0, ge=0, description="open requests that finished during a park")


class ServingSwitch:
    """Owns `engine.ready` once created: `ready` is True exactly while SERVING."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.kv_blocks = engine.kv_blocks  # the full budget, remembered across releases
        self.state = InstanceState.LOADING
        self._lock = asyncio.Lock()

    def warm(self, standby: bool) -> None:
        """Warm up (blocking, in a thread); a standby start warms on a small temporary KV, then releases it."""
        engine = self.engine
        if standby:
            engine.release_kv()
            engine.allocate_kv(min(WARM_UP_BLOCKS, self.kv_blocks))
        engine.warm_up()
        if not standby:
            self.state = InstanceState.SERVING
            return
        engine.ready = False
        _wait_idle(engine, 30.0)
        engine.release_kv()
        self.state = InstanceState.STANDBY
        log.info("standby: loaded and warm, KV released (%d blocks on activation)", self.kv_blocks)

    async def activate(self) -> SwitchReport:
        """Standby -> serving: allocate the full KV cache and admit requests. Serving already: a no-op."""
        async with self._lock:
            t0 = time.perf_counter()
            if self.state == InstanceState.STANDBY:
                await asyncio.to_thread(self.engine.allocate_kv, self.kv_blocks)
                self.state = InstanceState.SERVING
                self.engine.ready = True
                log.info("activated: %d KV blocks", self.kv_blocks)
            elif self.state != InstanceState.SERVING:
                raise SwitchError(f"the engine is {self.state.value}; only a standby engine can be activated")
            return self._report(t0)

    async def park(self, drain_s: float) -> SwitchReport:
        """Serving -> standby: refuse new requests, wait up to `drain_s` for open ones, release the KV."""
        async with self._lock:
            t0 = time.perf_counter()
            if self.state == InstanceState.STANDBY:
                return self._report(t0)
            if self.state != InstanceState.SERVING:
                raise SwitchError(f"the engine is {self.state.value}; only a serving engine can be parked")
            engine = self.engine
            self.state, engine.ready = InstanceState.PARKING, False
            open_at_start = engine.num_open
            deadline = time.monotonic() + drain_s
            while engine.num_open and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if engine.num_open:
                self.state, engine.ready = InstanceState.SERVING, True
                raise SwitchError(f"{engine.num_open} requests still open after {drain_s:g}s; "
                                  "the engine keeps serving them; park again later or with a longer drain")
            engine.release_kv()
            self.state = InstanceState.STANDBY
            log.info("parked: drained %d requests, KV released", open_at_start)
            report = self._report(t0)
            report.drained = open_at_start
            return report

    def _report(self, t0: float) -> SwitchReport:
        return SwitchReport(state=self.state, seconds=time.perf_counter() - t0, kv_blocks=self.engine.kv_blocks)


def _wait_idle(engine: LLMEngine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.num_open and time.monotonic() < deadline:
        time.sleep(0.01)
