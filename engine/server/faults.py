"""Fault injection for an engine server, for tests and drills only: slow tokens and failed requests.

`tideflow serve --faults '{"error_rate": 0.5}'` answers that share of completion/chat requests with
an OpenAI-style HTTP 500; the requests to fail are drawn from a seeded RNG, so a run is repeatable.
"""

from __future__ import annotations

import asyncio
import random
import threading

from engine.api.errors import APIError
from engine.api.fault_config import FaultConfig

INJECTED_CODE = "injected_fault"


class FaultInjector:
    """Applies one FaultConfig in the serving routes; thread-safe, draws in request arrival order."""

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raise the injected 500 for this request when the draw says so."""
        if self.config.error_rate <= 0:
            return
        with self._lock:
            fail = self._rng.random() < self.config.error_rate
        if fail:
            raise APIError(500, "injected fault: this engine fails a share of requests on purpose (--faults)",
                           code=INJECTED_CODE)

    def slow(self, stream):
        """`stream` itself, or a view of it that waits `token_delay_s` before each output."""
        return _SlowStream(stream, self.config.token_delay_s) if self.config.token_delay_s > 0 else stream


class _SlowStream:
    """Same interface as the engine's RequestStream (request_id, next, async iteration)."""

    def __init__(self, stream, delay_s: float) -> None:
        self._stream, self._delay_s = stream, delay_s

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    async def next(self, timeout_s: float):
        out = await self._stream.next(timeout_s)
        if out is not None:
            await asyncio.sleep(self._delay_s)
        return out

    async def __aiter__(self):
        async for out in self._stream:
            await asyncio.sleep(self._delay_s)
            yield out
