"""moto's S3 server in its own process on loopback, through the one process supervisor (engine.runtime.process): the
S3 the tests and benchmarks talk to over real HTTP."""

from __future__ import annotations

import sys
from pathlib import Path

from engine.runtime.process import Child, free_port, start_service


def start_moto(log: Path, timeout_s: float = 30.0) -> tuple[Child, str]:
    """The running server and its endpoint URL; ready once its data API answers."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return start_service("moto", argv, log, endpoint + "/moto-api/data.json", timeout_s=timeout_s), endpoint
