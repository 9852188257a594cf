"""One local controller per TIDEFLOW_HOME: an exclusive lock on $TIDEFLOW_HOME/controller.lock, held for the
controller's whole life.

Why a lock and not a look: two controllers started together both looked for a registered one before either had
registered (registration comes after start, seconds later), and both then adopted, started and stopped the same
members. flock is taken or refused atomically by the kernel and let go by it when the process ends, even by
SIGKILL, so a restarted controller never finds a stale lock. The file holds the holder's pid, which the refusal
names with the URL the holder registered (discovery), or says it is still starting.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from engine.control import discovery
from engine.runtime.errors import TideflowError
from engine.runtime.paths import home


class HomeLocked(TideflowError):
    """Another controller holds this home."""


class HomeLock:
    """Held from construction until release() or the process's end."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or home() / "controller.lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(self._fd)
            os.close(self._fd)
            raise HomeLocked(f"a controller already runs on {self.path.parent} ({holder}); `tideflow down` stops it, "
                             "or give this one another TIDEFLOW_HOME") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor lets the lock go
            self._fd = -1


def _holder(fd: int) -> str:
    """`pid N, URL` of the controller holding the lock, as far as it has told."""
    try:
        pid = int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        pid = 0
    if not pid:
        return "its pid not written yet"
    try:
        info = discovery.find()
    except discovery.NoController:
        info = None
    if info is not None and info.pid == pid:
        return f"pid {pid}, {info.url}"
    return f"pid {pid}, still starting"
