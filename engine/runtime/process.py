"""The one process supervisor: spawn a child in its own session, log to a file, stop and reap it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine.runtime.http import bearer_client


# Ports handed to children are drawn below Linux's ephemeral range (32768-60999 by default), where
# the kernel never places an outgoing connection: a port picked here and bound by a child a moment
# later cannot be taken in between by one of the many client sockets the tests and the router open.
_PORT_RANGE = (20000, 32000)
_handed_out: set[int] = set()  # never the same port twice from one process
_port_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, for a child to bind; outside the ephemeral range, unique per process."""
    with _port_lock:
        for _ in range(200):
            port = random.randint(*_PORT_RANGE)
            if port in _handed_out or not port_free(host, port):
                continue
            _handed_out.add(port)
            return port
    raise OSError(f"no free port in {_PORT_RANGE[0]}-{_PORT_RANGE[1]} on {host}")


def port_free(host: str, port: int) -> bool:
    """Nobody listens on `port` now, so a server may bind it. With SO_REUSEADDR, as uvicorn binds: connections
    of a stopped server left in TIME-WAIT do not make its port read as busy (a restarted controller takes
    its old port back, and the router that watches that URL is kept)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), None when no such live process.

    pid + start time names one process for its whole life: a pid reused after a crash has another
    start time, so a restarted controller never adopts (or signals) a stranger. Zombies count as gone.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and parentheses
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def die_with_parent(parent: int) -> None:
    """End this process (SIGTERM) when the process that started it ends, even while it loads for minutes: a
    member's engine core and API servers serve nobody without it. `parent` is the starter's pid as the starter
    gave it (its os.getpid()), so a starter that died while this process imported is seen too. Linux only
    (prctl); elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class Child:
    """A supervised child process. `stop()` always reaps it: SIGTERM, then SIGKILL after `grace_s`."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, env: dict[str, str] | None = None) -> None:
        """`log_path` None: the child writes to this process's own stdout and stderr (a member's engine core)."""
        self.name, self.argv, self.log_path = name, argv, log_path
        self._log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        self.started = time.monotonic()
        self.start_ticks = start_ticks(self.proc.pid) or 0

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
            self.kill(signal.SIGCONT)  # a stopped process (SIGSTOP, a debugger) takes the SIGTERM only once continued
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill(signal.SIGKILL)  # also reaps grandchildren left in the session
        code = self.proc.wait()
        if self._log is not None:
            self._log.close()
        return code

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None:
            return ""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


class Adopted:
    """A process another (earlier) supervisor started, taken over by pid + start time.

    It is not our child, so it cannot be waited for: liveness comes from /proc, and every signal is
    sent only while the pid still names the same process. Same surface as `Child`.
    """

    def __init__(self, name: str, pid: int, ticks: int, log_path: Path) -> None:
        self.name, self.pid, self.start_ticks, self.log_path = name, pid, ticks, log_path

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.start_ticks

    @property
    def returncode(self) -> int | None:
        """None while alive; -9 once gone (an adopted process's real exit code cannot be read)."""
        return None if self.alive() else -signal.SIGKILL

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            try:
                os.killpg(self.pid, sig)  # started with its own session: pgid == pid
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float = 5.0) -> int:
        self.kill(signal.SIGTERM)
        self.kill(signal.SIGCONT)  # see Child.stop
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill(signal.SIGKILL)
        while self.alive() and time.monotonic() < deadline + 5:
            time.sleep(0.05)
        return -signal.SIGKILL

    log_tail = Child.log_tail


def adopt(name: str, pid: int, ticks: int, log_path: Path) -> Adopted | None:
    """The running process `pid` if it is still the one that started at `ticks`, else None."""
    return Adopted(name, pid, ticks, log_path) if start_ticks(pid) == ticks else None


def loopback_members(host: str) -> list[str]:
    """Router flags for a fleet bound to loopback: it accepts member endpoints on loopback only."""
    return ["--member-network", "127.0.0.0/8"] if host.startswith("127.") or host == "localhost" else []


def tideflow_argv(*args: str) -> list[str]:
    """An engine command (engine.main) run with this interpreter, so children use the same environment."""
    return [sys.executable, "-m", "engine.main", *args]


def wait_http_ok(url: str, timeout_s: float, child: Child | None = None, key: str | None = None) -> bool:
    """Poll `url` until it answers 200 (with the bearer `key`, if given); False on timeout or when `child`
    exits first."""
    deadline = time.monotonic() + timeout_s
    client = bearer_client(key, timeout_s=1.0)
    try:
        while time.monotonic() < deadline:
            if child is not None and not child.alive():
                return False
            try:
                if client.get(url).status_code == 200:
                    return True
            except httpx.HTTPError:
                if url.startswith("https://"):  # a controller makes the fleet CA as it starts: trusted from then on
                    client.close()
                    client = bearer_client(key, timeout_s=1.0)
            time.sleep(0.05)
        return False
    finally:
        client.close()


def start_service(name: str, argv: list[str], log_path: Path, health_url: str, timeout_s: float = 60.0,
                  env: dict[str, str] | None = None) -> Child:
    """A Child that answers 200 on `health_url` within `timeout_s`; on failure it is reaped and the
    error carries its log's tail."""
    child = Child(name, argv, log_path, env)
    try:
        if not wait_http_ok(health_url, timeout_s=timeout_s, child=child):
            raise RuntimeError(f"{name} did not come up within {timeout_s:.0f}s: {child.log_tail()}")
    except BaseException:
        child.stop()
        raise
    return child
