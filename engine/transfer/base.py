"""The KV transfer contract between a prefill worker (sender) and a decode worker (receiver).

The sender stages a sequence's exported KV bytes and hands out a descriptor; the decode worker
pulls the bytes with that descriptor. A fetch either returns every byte intact or raises
KVTransferError within its timeout: it never hangs the decode worker.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

from pydantic import BaseModel, Field

from engine.runtime.errors import TideflowError

TransportKind = Literal["shm", "tcp"]


class KVTransferError(TideflowError):
    """A transfer failed, timed out or arrived corrupted; the request it served fails with it."""


class TransferDescriptor(BaseModel):
    """Where and what to fetch; travels as JSON from prefill through the router to decode."""

    transport: TransportKind
    transfer_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    nbytes: int = Field(ge=0)
    checksum: int | None = Field(None, description="CRC-32 of the payload (TCP only)")
    location: dict[str, Any] = Field(default_factory=dict, description="transport-specific address")


class KVSender(abc.ABC):
    """Stages payloads until a receiver takes them or they expire."""

    @abc.abstractmethod
    def stage(self, transfer_id: str, nbytes: int) -> memoryview:
        """A writable buffer of `nbytes` to export the KV blocks into (one copy, no more)."""

    @abc.abstractmethod
    def commit(self, transfer_id: str) -> TransferDescriptor:
        """Seal the staged buffer and describe how to fetch it."""

    @abc.abstractmethod
    def discard(self, transfer_id: str) -> None:
        """Drop a staged payload (request cancelled or failed)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything still staged."""


class KVReceiver(abc.ABC):
    @abc.abstractmethod
    def fetch(self, desc: TransferDescriptor, timeout_s: float) -> memoryview:
        """The payload's bytes; raises KVTransferError on failure, corruption or timeout."""

    def release(self, desc: TransferDescriptor) -> None:
        """Free transport resources held for `desc` after its bytes were consumed."""
