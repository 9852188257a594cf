"""A member whose engine core runs in a process of its own: the core, and N API server processes in front of it.

`serve --engine-core process --api-server-count N`: this process starts the core (engine/core/core_process.py),
serves as API server 0 (it warms the core up, and owns the standby switch) and starts API servers 1..N-1
(`python -m engine.server.api_servers SPEC`). Every API server binds the same port with SO_REUSEPORT, so the
kernel spreads connections over them; each tokenizes, detokenizes and streams its own requests, and all feed
the one core. An API server that dies is started again (the core has aborted its requests by then); when
the core dies, every API server ends its streams and exits, and the group is rebuilt.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import uvicorn
from pydantic import BaseModel, Field

from engine.runtime.errors import EXIT_ENGINE_FAILED, exit_member
from engine.runtime.process import Child, die_with_parent
from engine.api.auth import key_source
from engine.api.connection_limits import ConnectionLimits
from engine.api.connections import listening_socket, server_config
from engine.runtime.tls import TlsIdentity
from engine.server.core_client import CoreClient
from engine.api.fault_config import FaultConfig
from engine.server.faults import FaultInjector
from engine.api.limits import DEFAULT_MAX_BODY_BYTES, MEMBER_KEEP_ALIVE_S
from engine.model.tokenizer import Tokenizer
from engine.telemetry import tracing

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 1.0


class ApiServerSpec(BaseModel):
    """What an API server process needs: where to listen, which core to feed, how to check requests."""

    model_dir: str = Field(description="the checkpoint directory: its tokenizer")
    model_name: str
    input_address: str = Field(description="the core's ROUTER (ipc://...)")
    socket_dir: str = Field(description="the member's private folder of ipc sockets")
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    api_key_file: str | None = Field(None, description="keys also come from $TIDEFLOW_API_KEYS, inherited")
    faults: str | None = None
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)
    reuse_port: bool = Field(False, description="share the port with the member's other API servers")
    connections: ConnectionLimits = Field(default_factory=ConnectionLimits,
                                          description="bounded reads; each API server counts its own connections")
    starter_pid: int = Field(default_factory=os.getpid, description="an API server ends when this process does")
    identity: TlsIdentity | None = Field(None, description="serve TLS with this certificate (None: plain HTTP)")
    mutual: bool = Field(False, description="clients must show a certificate from the identity's CA")


def serve_api(spec: ApiServerSpec, client: CoreClient, warm_up: bool, standby: bool = False) -> None:
    """Serve the OpenAI API over `client` until the process is told to stop."""
    from engine.server.app import create_app

    faults = FaultInjector(FaultConfig.parse(spec.faults)) if spec.faults else None
    app = create_app(client, spec.model_name, key_source(spec.api_key_file), warm_up=warm_up, faults=faults,
                     standby=standby, host=spec.host, max_body_bytes=spec.max_body_bytes,
                     body_timeout_s=spec.connections.body_timeout_s)
    sock = listening_socket(spec.host, spec.port, spec.reuse_port)
    server = uvicorn.Server(server_config(app, spec.connections, log_level="warning", identity=spec.identity,
                                          mutual=spec.mutual, timeout_keep_alive=MEMBER_KEEP_ALIVE_S))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class ExtraApiServers:
    """API servers 1..N-1 of a member, kept running: one that exits is started again after RESTART_PAUSE_S."""

    def __init__(self, spec: ApiServerSpec, count: int) -> None:
        self.spec, self.count = spec, count
        self.children: list[Child] = [self._start(i) for i in range(1, count)]
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tideflow-api-servers", daemon=True)
        self._watcher.start()

    def _start(self, index: int) -> Child:
        argv = [sys.executable, "-m", "engine.server.api_servers", self.spec.model_dump_json()]
        return Child(f"api-server-{index}", argv, None)

    def _watch(self) -> None:
        while not self._stopping.wait(RESTART_PAUSE_S):
            for i, child in enumerate(self.children):
                if not child.alive() and not self._stopping.is_set():
                    log.warning("API server %d exited with status %s; starting it again", i + 1, child.returncode)
                    child.stop()
                    self.children[i] = self._start(i + 1)

    def stop(self) -> None:
        self._stopping.set()
        self._watcher.join(timeout=5)
        for child in self.children:
            child.stop()


def remove_socket_dir(path: str | Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str]) -> int:
    """An extra API server: connect to the member's core and serve until stopped or the core is gone."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s api-server %(name)s: %(message)s")
    spec = ApiServerSpec.model_validate_json(argv[0])
    die_with_parent(spec.starter_pid)
    tracing.setup("colocated")  # an engine core apart serves the colocated role alone (engine/server/cli.py)
    client = CoreClient(spec.input_address, Tokenizer(spec.model_dir), Path(spec.socket_dir), connect_timeout_s=60)
    client.on_failure = lambda why: exit_member(EXIT_ENGINE_FAILED, why)
    serve_api(spec, client, warm_up=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
