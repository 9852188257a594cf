"""Who is switching each group between serving and standby now: a user's verb, a warm replacement, or one of
reconcile's converge threads. Reconcile leaves a claimed group alone, and a claim is taken in one step (check and
take under one lock), so two of them never start the same park or activation."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SwitchClaims:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_group: dict[str, threading.Thread] = {}
        self._threads: list[threading.Thread] = []  # the claims' own threads, joined on close

    def busy(self, name: str) -> bool:
        with self._lock:
            return name in self._by_group

    def claim(self, name: str) -> bool:
        """Claim `name` for this thread if nobody holds it; whether it did."""
        with self._lock:
            if name in self._by_group:
                return False
            self._by_group[name] = threading.current_thread()
            return True

    @contextmanager
    def holding(self, name: str) -> Iterator[None]:
        """This thread switches `name` (a verb, a replacement): claimed for the block, whoever held it."""
        with self._lock:
            self._by_group[name] = threading.current_thread()
        try:
            yield
        finally:
            self.release(name)

    def release(self, name: str) -> None:
        """Let go of `name`, if this thread holds it."""
        with self._lock:
            if self._by_group.get(name) is threading.current_thread():
                del self._by_group[name]

    def start(self, name: str, target: Callable[[], None]) -> bool:
        """Run `target` on a thread of its own that holds `name` (it releases it itself); False, and nothing runs,
        when someone holds it already."""
        t = threading.Thread(target=target, name=f"converge-{name}", daemon=True)
        with self._lock:
            if name in self._by_group:
                return False
            self._by_group[name] = t
            self._threads = [c for c in self._threads if c.is_alive()] + [t]
        t.start()
        return True

    def join(self, timeout_s: float) -> None:
        """Wait for the claims' own threads (no switch may still run once the controller stops)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for t in threads:
            t.join(timeout=timeout_s)
