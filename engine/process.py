"""The one process supervisor: spawn a child in its own session, log to a file, stop and reap it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Child:
    """A supervised child process. `stop()` always reaps it: SIGTERM, then SIGKILL after `grace_s`."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's whole session (it may have spawned ranks of its own)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 5.0) -> int:
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # also reaps grandchildren left in the session
        code = self.proc.wait()
        self._log.close()
        return code

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


def tideflow_argv(*args: str) -> list[str]:
    """Run the CLI with this interpreter, so children use the same environment."""
    return [sys.executable, "-m", "flows.cli", *args]


def wait_http_ok(url: str, timeout_s: float, child: Child | None = None, headers: dict | None = None) -> bool:
    """Poll `url` until it answers 200; False on timeout or when `child` exits first."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, headers=headers or {}) as client:
        while time.monotonic() < deadline:
            if child is not None and not child.alive():
                return False
            try:
                if client.get(url, timeout=1.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    return False
