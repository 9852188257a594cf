"""Same-host transfer through POSIX shared memory: the decode worker maps the prefill's segment.

One copy on each side: prefill exports KV blocks straight into the segment, decode imports them
straight out of it. The receiver unlinks a segment once consumed; the sender unlinks the ones
nobody claimed within `ttl_s` (a decode worker died mid-request, say). A segment's name carries the
sender's pid, so what a dead sender left behind is found and unlinked by `reap_orphan_segments`.
"""

from __future__ import annotations

import os
import threading
import time
import _posixshmem
from pathlib import Path
from multiprocessing import resource_tracker, shared_memory

from engine.transfer.base import KVReceiver, KVSender, KVTransferError, TransferDescriptor

PREFIX = "tideflow-kv-"
SHM_DIR = Path("/dev/shm")


def segment_name(transfer_id: str, pid: int | None = None) -> str:
    """tideflow-kv-<sender pid>-<transfer id>."""
    return f"{PREFIX}{os.getpid() if pid is None else pid}-{transfer_id}"


def reap_orphan_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the KV segments whose sender process is gone (killed mid-transfer, or stopped with transfers
    nobody claimed); returns their names. A segment still mapped by a receiver stays readable until closed."""
    reaped = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return reaped
    for entry in entries:
        pid_text = entry.name[len(PREFIX):].split("-", 1)[0] if entry.name.startswith(PREFIX) else ""
        if not pid_text.isdigit() or Path(f"/proc/{pid_text}").exists():
            continue
        _unlink(entry.name)
        reaped.append(entry.name)
    return reaped


def _untracked(segment: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    """Ownership moves between processes; stop Python's tracker from unlinking it at exit."""
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


class ShmSender(KVSender):
    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._staged: dict[str, tuple[int, float]] = {}  # id -> (nbytes, committed at)
        self._lock = threading.Lock()

    def stage(self, transfer_id: str, nbytes: int) -> memoryview:
        self.expire()
        seg = _untracked(shared_memory.SharedMemory(name=segment_name(transfer_id), create=True, size=max(nbytes, 1)))
        with self._lock:
            self._segments[transfer_id] = seg
            self._staged[transfer_id] = (nbytes, time.monotonic())
        return seg.buf[:nbytes]

    def commit(self, transfer_id: str) -> TransferDescriptor:
        """Caller must have released its staged view; our mapping closes, the segment stays."""
        with self._lock:
            seg = self._segments.pop(transfer_id)
            nbytes, _ = self._staged[transfer_id]
            self._staged[transfer_id] = (nbytes, time.monotonic())
        seg.close()
        return TransferDescriptor(transport="shm", transfer_id=transfer_id, nbytes=nbytes,
                                  location={"name": segment_name(transfer_id)})

    def discard(self, transfer_id: str) -> None:
        with self._lock:
            seg = self._segments.pop(transfer_id, None)
            self._staged.pop(transfer_id, None)
        if seg is not None:
            seg.close()
        _unlink(segment_name(transfer_id))

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [k for k, (_, t) in self._staged.items() if now - t > self.ttl_s and k not in self._segments]
            for k in old:
                del self._staged[k]
        for k in old:
            _unlink(segment_name(k))

    def close(self) -> None:
        with self._lock:
            ids = list(self._staged)
        for k in ids:
            self.discard(k)


class ShmReceiver(KVReceiver):
    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}

    def fetch(self, desc: TransferDescriptor, timeout_s: float) -> memoryview:
        try:
            seg = _untracked(shared_memory.SharedMemory(name=desc.location["name"]))
        except FileNotFoundError:
            raise KVTransferError(f"KV transfer {desc.transfer_id}: shared memory segment is gone "
                                  "(expired, or the prefill worker died)") from None
        if seg.size < desc.nbytes:
            seg.close()
            raise KVTransferError(f"KV transfer {desc.transfer_id}: segment holds {seg.size} bytes, expected {desc.nbytes}")
        self._open[desc.transfer_id] = seg
        return seg.buf[: desc.nbytes]

    def release(self, desc: TransferDescriptor) -> None:
        """Caller must have released the fetched view."""
        seg = self._open.pop(desc.transfer_id, None)
        if seg is not None:
            seg.close()
            _unlink(seg.name)


def _unlink(name: str) -> None:
    """Remove the segment by name; SharedMemory.unlink would also unregister it from the tracker,
    which we already did, and the tracker process would complain."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
