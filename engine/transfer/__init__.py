"""KV cache transfer between prefill and decode workers: shared memory or TCP, one interface. TCP is mutual TLS
when the process has the fleet's identity (engine.runtime.tls), as every other hop between processes."""

from engine.runtime import tls
from engine.transfer.base import KVReceiver, KVSender, KVTransferError, TransferDescriptor, TransportKind
from engine.transfer.shm import ShmReceiver, ShmSender
from engine.transfer.tcp import TcpReceiver, TcpSender


def make_sender(kind: TransportKind, host: str = "127.0.0.1", stall_s: float = 0.0) -> KVSender:
    return ShmSender() if kind == "shm" else TcpSender(host=host, stall_s=stall_s, context=tls.server_context())


def make_receiver(kind: TransportKind) -> KVReceiver:
    return ShmReceiver() if kind == "shm" else TcpReceiver(tls.client_context())


__all__ = ["KVReceiver", "KVSender", "KVTransferError", "TransferDescriptor", "TransportKind", "ShmSender",
           "ShmReceiver", "TcpSender", "TcpReceiver", "make_sender", "make_receiver"]
