"""Cross-host transfer over TCP: the prefill worker serves staged payloads, decode pulls them.

Frames: request  = MAGIC | u16 id length | id
        response = MAGIC | u8 status | u64 nbytes | u32 crc32 | payload
Each payload is served once; its CRC-32 is computed at commit and checked on arrival. With the fleet's TLS on
(engine.runtime.tls), both ends are mutual TLS: only a peer with the fleet CA's certificate may pull KV, and the
KV crosses the network encrypted.
"""

from __future__ import annotations

import socket
import socketserver
import ssl
import struct
import threading
import time
import zlib

from engine.transfer.base import KVReceiver, KVSender, KVTransferError, TransferDescriptor

MAGIC = b"TFKV"
REQUEST = struct.Struct("!4sH")
RESPONSE = struct.Struct("!4sBQI")
FOUND, MISSING = 0, 1


class TcpSender(KVSender):
    """Serves staged payloads on (host, port); `stall_s` delays every response (fault drills); `context`: a
    server SSL context (mutual TLS), None for plain TCP."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, ttl_s: float = 60.0, stall_s: float = 0.0,
                 context: ssl.SSLContext | None = None) -> None:
        self.ttl_s, self.stall_s, self.context = ttl_s, stall_s, context
        self._staged: dict[str, tuple[bytearray, int | None, float]] = {}
        self._lock = threading.Lock()
        sender = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    sender._serve(self.request)
                except (OSError, TimeoutError, KVTransferError):
                    pass  # the receiver went away, timed out or failed the handshake; it reports the failure itself

        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-tcp-sender", daemon=True)
        self._thread.start()

    def stage(self, transfer_id: str, nbytes: int) -> memoryview:
        self.expire()
        buf = bytearray(nbytes)
        with self._lock:
            self._staged[transfer_id] = (buf, None, time.monotonic())
        return memoryview(buf)

    def commit(self, transfer_id: str) -> TransferDescriptor:
        with self._lock:
            buf, _, _ = self._staged[transfer_id]
        crc = zlib.crc32(buf)
        with self._lock:
            self._staged[transfer_id] = (buf, crc, time.monotonic())
        return TransferDescriptor(transport="tcp", transfer_id=transfer_id, nbytes=len(buf), checksum=crc,
                                  location={"host": self.host, "port": self.port})

    def discard(self, transfer_id: str) -> None:
        with self._lock:
            self._staged.pop(transfer_id, None)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, (_, _, t) in self._staged.items() if now - t > self.ttl_s]:
                del self._staged[k]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            self._staged.clear()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        if self.context is not None:
            conn = self.context.wrap_socket(conn, server_side=True)  # closed with the raw socket by socketserver
        magic, n = REQUEST.unpack(_recv_exact(conn, REQUEST.size, time.monotonic() + 30))
        if magic != MAGIC:
            return
        transfer_id = _recv_exact(conn, n, time.monotonic() + 30).decode()
        if self.stall_s:
            time.sleep(self.stall_s)
        with self._lock:
            entry = self._staged.pop(transfer_id, None)
        if entry is None or entry[1] is None:
            conn.sendall(RESPONSE.pack(MAGIC, MISSING, 0, 0))
            return
        buf, crc, _ = entry
        conn.sendall(RESPONSE.pack(MAGIC, FOUND, len(buf), crc))
        conn.sendall(buf)


class TcpReceiver(KVReceiver):
    """Pulls payloads from a TcpSender; `context`: a client SSL context (its certificate shown), None for plain TCP."""

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        self.context = context

    def fetch(self, desc: TransferDescriptor, timeout_s: float) -> memoryview:
        deadline = time.monotonic() + timeout_s
        host, port = desc.location["host"], int(desc.location["port"])
        where = f"KV transfer {desc.transfer_id} from {host}:{port}"
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as raw, self._wrap(raw, host) as conn:
                ident = desc.transfer_id.encode()
                conn.sendall(REQUEST.pack(MAGIC, len(ident)) + ident)
                magic, status, nbytes, crc = RESPONSE.unpack(_recv_exact(conn, RESPONSE.size, deadline))
                if magic != MAGIC:
                    raise KVTransferError(f"{where}: bad frame (not a tideflow KV server?)")
                if status == MISSING:
                    raise KVTransferError(f"{where}: the sender no longer holds it (expired or already taken)")
                if nbytes != desc.nbytes or crc != desc.checksum:
                    raise KVTransferError(f"{where}: header says {nbytes} bytes crc {crc}, descriptor {desc.nbytes}/{desc.checksum}")
                payload = _recv_exact(conn, nbytes, deadline)
        except (socket.timeout, TimeoutError):
            raise KVTransferError(f"{where}: timed out after {timeout_s:.1f}s") from None
        except OSError as exc:  # ssl.SSLError too: a sender whose certificate is not the fleet's, or that refused ours
            raise KVTransferError(f"{where}: {exc}") from None
        if zlib.crc32(payload) != desc.checksum:
            raise KVTransferError(f"{where}: checksum mismatch, payload corrupted in flight")
        return memoryview(payload)


    def _wrap(self, raw: socket.socket, host: str) -> socket.socket:
        return self.context.wrap_socket(raw, server_hostname=host) if self.context is not None else raw


def _recv_exact(conn: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn.settimeout(remaining)
        k = conn.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            raise KVTransferError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf
