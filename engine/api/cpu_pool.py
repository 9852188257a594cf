"""Where a server's CPU-bound request work runs: the router's parsing of large bodies, tokenizing, templating,
hashing and serializing of prompts; a member's templating and tokenizing. Never on the event loop, which must
answer every client and /health at once, and never on more threads than a few.

A few threads, admitted by a semaphore, with a bounded number of jobs waiting: past it the client gets
a 503 at once rather than a queue that grows with whoever sends the largest prompts. Threads still share
the GIL, but the interpreter hands it back to the loop every switch interval (5 ms), so one 7 MB prompt
costs other clients milliseconds, not the seconds it held the loop for before.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from engine.api.errors import APIError

T = TypeVar("T")

INLINE_BYTES = 64 << 10  # a body below this parses in well under a millisecond: on the loop, no thread hop


class CpuPool:
    def __init__(self, workers: int, max_waiting: int, name: str = "router") -> None:
        self.workers, self.max_waiting, self.name = workers, max_waiting, name
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-cpu")
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it
        self._waiting = 0

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a worker thread; 503 when `max_waiting` jobs already wait for one."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        if self._waiting >= self.max_waiting:
            raise APIError(503, f"the {self.name} is busy preparing {self._waiting} large prompts; retry shortly",
                           code=f"{self.name}_busy")
        self._waiting += 1
        try:
            async with self._slots:
                return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._waiting -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
