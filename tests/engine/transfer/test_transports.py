"""Both KV transports: intact bytes across processes, clear failures, bounded waits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from multiprocessing import shared_memory

import pytest

from engine.transfer import KVTransferError, TransferDescriptor, make_receiver, make_sender
from engine.transfer.shm import SHM_DIR, ShmSender, reap_orphan_segments, segment_name

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

RECEIVE_IN_CHILD = """
import hashlib, json, sys
from engine.transfer import TransferDescriptor, make_receiver
desc = TransferDescriptor.model_validate_json(sys.argv[1])
rx = make_receiver(desc.transport)
view = rx.fetch(desc, timeout_s=10)
digest = hashlib.sha256(view).hexdigest()
view.release()
rx.release(desc)
print(digest)
"""


def stage_payload(sender, transfer_id: str, payload: bytes) -> TransferDescriptor:
    view = sender.stage(transfer_id, len(payload))
    view[:] = payload
    view.release()
    return sender.commit(transfer_id)


@pytest.fixture(params=["shm", "tcp"])
def sender(request):
    tx = make_sender(request.param)
    yield tx
    tx.close()


def test_payload_arrives_intact_in_another_process(sender):
    import hashlib

    payload = os.urandom(3 * 2**20 + 7)
    desc = stage_payload(sender, "xproc", payload)
    child = subprocess.run([sys.executable, "-c", RECEIVE_IN_CHILD, desc.model_dump_json()],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == hashlib.sha256(payload).hexdigest()


def test_each_payload_is_taken_once(sender):
    desc = stage_payload(sender, "once", b"kv-bytes")
    rx = make_receiver(desc.transport)
    view = rx.fetch(desc, timeout_s=5)
    assert bytes(view) == b"kv-bytes"
    view.release()
    rx.release(desc)
    with pytest.raises(KVTransferError, match="once"):
        rx.fetch(desc, timeout_s=5)


def test_tcp_corruption_in_flight_is_detected():
    tx = make_sender("tcp")
    try:
        view = tx.stage("corrupt", 4096)
        view[:] = bytes(4096)
        desc = tx.commit("corrupt")
        view[100] = 1  # the bytes change after the checksum was taken
        view.release()
        with pytest.raises(KVTransferError, match="checksum mismatch"):
            make_receiver("tcp").fetch(desc, timeout_s=5)
    finally:
        tx.close()


def test_tcp_stall_times_out_within_bound():
    tx = make_sender("tcp", stall_s=5.0)
    try:
        desc = stage_payload(tx, "stalled", b"x" * 1000)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="timed out after 0.5s"):
            make_receiver("tcp").fetch(desc, timeout_s=0.5)
        assert time.monotonic() - t0 < 4.0  # well before the 5 s stall ends: the timeout, not the stall, ended it
    finally:
        tx.close()


def test_tcp_dead_sender_is_a_clear_error():
    tx = make_sender("tcp")
    desc = stage_payload(tx, "dead", b"abc")
    tx.close()
    with pytest.raises(KVTransferError, match=f"KV transfer dead from 127.0.0.1:{desc.location['port']}"):
        make_receiver("tcp").fetch(desc, timeout_s=2)


def test_unclaimed_shm_segments_expire():
    tx = ShmSender(ttl_s=0.0)
    try:
        desc = stage_payload(tx, "orphan", b"abc")
        tx.expire()
        with pytest.raises(KVTransferError, match="segment is gone"):
            make_receiver("shm").fetch(desc, timeout_s=1)
    finally:
        tx.close()


def test_descriptor_rejects_hostile_ids():
    with pytest.raises(ValueError):
        TransferDescriptor.model_validate(json.loads('{"transport": "shm", "transfer_id": "../etc", "nbytes": 1}'))


def test_segments_of_a_dead_sender_are_reaped_and_a_live_senders_kept():
    """A decode killed mid-transfer and a prefill stopped with it leave segments nobody unlinks; the controller's
    reaper removes those whose sender is gone, never one a live sender still owns."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)  # exited: the pid names no process now (a reuse within this test is implausible)
    orphan = shared_memory.SharedMemory(name=segment_name("orphan-1", pid=dead_pid), create=True, size=64)
    orphan.close()
    live = ShmSender()
    live.stage("live-1", 64).release()
    live.commit("live-1")
    try:
        reaped = reap_orphan_segments()
        assert segment_name("orphan-1", pid=dead_pid) in reaped
        assert not (SHM_DIR / segment_name("orphan-1", pid=dead_pid)).exists()
        assert (SHM_DIR / segment_name("live-1")).exists() and segment_name("live-1") not in reaped
    finally:
        live.close()
        try:
            orphan.unlink()
        except FileNotFoundError:
            pass
