"""Bounded reads for every HTTP server tideflow runs (members, the router, the encoder, the controller): a
request's head must arrive within `header_timeout_s`, and one client address may hold at most
`max_connections_per_address` connections. A slow or hoarding client is answered 408 or 503 and closed,
instead of holding sockets for ever until the process reaches its descriptor limit and slows for everyone
(20,000 held connections did that to the router). The body's own read timeout is
engine.api.limits.BodyLimit's; the bounds and their flags are engine.api.connection_limits'.

uvicorn (h11) has an idle keep-alive timeout but no bound on a request's head nor on connections per
address; this protocol adds both and is otherwise uvicorn's own.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections import Counter

import uvicorn
from uvicorn.main import STARTUP_FAILURE
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.api.connection_limits import ConnectionLimits
from engine.runtime import tls
from engine.runtime.tls import TlsIdentity


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def bounded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits` on the head and on connections per address (one count per server)."""
    open_per_address: Counter[str] = Counter()

    class BoundedH11Protocol(H11Protocol):
        _address: str | None = None
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            address = peer[0] if isinstance(peer, tuple) else None
            cap = limits.max_connections_per_address
            if address is not None and open_per_address[address] >= cap:
                transport.write(_refusal(503, "Service Unavailable", f"{address} holds {cap} connections already; "
                                                                     "reuse or close them"))
                transport.close()
                return
            if address is not None:
                open_per_address[address] += 1
                self._address = address
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._address is not None:
                open_per_address[self._address] -= 1
                if open_per_address[self._address] <= 0:
                    del open_per_address[self._address]
                self._address = None
            if self._head_timer is not None:
                self._head_timer.cancel()
            if getattr(self, "transport", None) is not None:  # refused connections never got one
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if self._head_timer is None and (before is None or before.response_complete):
                self._await_head()  # the first bytes of a next request on a kept-alive connection: same bound
            super().data_received(data)
            if self.cycle is not before and self._head_timer is not None:  # a new request's head is in
                self._head_timer.cancel()
                self._head_timer = None

        def _await_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            self.transport.write(_refusal(408, "Request Timeout",
                                          f"no request head within {limits.header_timeout_s:g}s"))
            self.transport.close()

    return BoundedH11Protocol


class ReloadingTlsConfig(uvicorn.Config):
    """uvicorn's Config whose TLS context follows its certificate file: a renewed certificate is served to the
    next handshake, with no restart."""

    def __init__(self, app, identity: TlsIdentity | None, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self.identity = identity

    def load(self) -> None:
        super().load()
        if self.ssl is not None and self.identity is not None:
            tls.reloader.watch(self.ssl, self.identity)


def server_config(app, limits: ConnectionLimits, *, identity: TlsIdentity | None = None, mutual: bool = False,
                  **kwargs) -> uvicorn.Config:
    """uvicorn's Config with tideflow's bounded reads, served over TLS with `identity` when one is given
    (`mutual`: clients must show a certificate from its CA); `kwargs` are uvicorn's own (host, port...)."""
    return ReloadingTlsConfig(app, identity, http=bounded_protocol(limits), **tls.server_kwargs(identity, mutual),
                              **kwargs)


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A socket bound to (host, port) for uvicorn; with `reuse_port`, other processes may bind the same
    (SO_REUSEPORT: the kernel spreads new connections over the processes that listen, and stops sending
    any to one that has closed its socket or died)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_server(app, limits: ConnectionLimits, *, host: str, port: int, reuse_port: bool = False,
               own_socket: socket.socket | None = None, **kwargs) -> None:
    """uvicorn.run with bounded reads, ending as it does: SIGINT/SIGTERM are a clean exit, a failed start exit 3.

    With `reuse_port` the port is shared with other replicas of this server. uvicorn binds before its
    lifespan starts but listens only after it, so a replica gets no connection before it is set up.
    `own_socket` (bound already) is served as well: where this process alone answers."""
    server = uvicorn.Server(server_config(app, limits, host=host, port=port, **kwargs))
    try:
        sock = listening_socket(host, port, reuse_port) if reuse_port or own_socket is not None else None
    except OSError as exc:
        print(f"cannot bind {host}:{port}: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    sockets = [s for s in (sock, own_socket) if s is not None]
    try:
        server.run(sockets=sockets or None)
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has shut down
        pass
    finally:
        for s in sockets:
            s.close()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
