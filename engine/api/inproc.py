"""Serve an ASGI app on a thread of this process, on a socket bound to a free loopback port first (the
port cannot be taken between choosing and binding). Reference servers and tests use it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import uvicorn

from engine.api.connections import ReloadingTlsConfig
from engine.runtime import tls
from engine.runtime.tls import TlsIdentity


@contextlib.contextmanager
def serve_in_thread(app, name: str = "asgi", host: str = "127.0.0.1", port: int = 0,
                    identity: TlsIdentity | None = None, mutual: bool = False, **config) -> Iterator[str]:
    """Yield the base URL once uvicorn answers (https with `identity`, as engine.api.connections serves it);
    always stop the server and close the socket."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the port is bound again once this server stops
    sock.bind((host, port))
    server = uvicorn.Server(ReloadingTlsConfig(app, identity, log_level="warning", **tls.server_kwargs(identity, mutual),
                                               **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"{name}: uvicorn did not start")
            time.sleep(0.02)
        yield f"{'https' if identity else 'http'}://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
