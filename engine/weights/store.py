"""The ObjectStore interface: what publish, verify and pull need from S3 or a directory.

Keys are relative to the store's version prefix. Large objects are written only through
multipart uploads, so every object carries a composite SHA-256 (sha256 of the part digests)
that verify compares with the manifest without reading the bytes.
"""

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from engine.weights.config import TransferConfig


@dataclass(frozen=True)
class StoredPart:
    """One part of an upload, as the store reports it."""

    number: int
    size: int
    sha256: str | None  # base64 digest; None when the store does not report it
    etag: str | None = None


@dataclass(frozen=True)
class ListedObject:
    """An object found by a listing: its key (relative to the store's prefix), size and last write time."""

    key: str
    size: int
    modified: float  # seconds since the epoch


@dataclass(frozen=True)
class StoredObject:
    """A committed object: size and its stored checksum (base64, no '-N' part-count suffix)."""

    size: int
    sha256: str | None
    parts: int | None


class StoreCounters:
    """Thread-safe tallies of what a store object sent and received (tests and reports read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.parts_uploaded = 0
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0

    def uploaded(self, nbytes: int) -> None:
        with self._lock:
            self.parts_uploaded += 1
            self.bytes_uploaded += nbytes

    def downloaded(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_downloaded += nbytes


class ObjectStore(ABC):
    """A version's location in an object store; safe to call from many threads at once."""

    def __init__(self, config: TransferConfig, url: str):
        self.config = config
        self.url = url
        self.counters = StoreCounters()

    @abstractmethod
    def head(self, key: str) -> StoredObject | None:
        """Size and stored checksum of a committed object, None when absent."""

    @abstractmethod
    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of the object from `start` (raises ObjectMissingError when absent)."""

    @abstractmethod
    def read_bytes(self, key: str) -> bytes | None:
        """A whole small object (the manifest), None when absent."""

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Atomically write a whole small object (the manifest)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; absent is fine."""

    @abstractmethod
    def list_objects(self, prefix: str) -> Iterator[ListedObject]:
        """Committed objects whose key starts with `prefix`, in no set order."""

    @abstractmethod
    def expire_prefix(self, prefix: str, days: int) -> bool:
        """Have the store itself delete objects under `prefix` `days` after their last write (an S3 lifecycle rule);
        False where the store cannot (a directory: the kv-gc deployment deletes them instead)."""

    @abstractmethod
    def open_upload(self, key: str) -> str | None:
        """The id of an unfinished upload for the key (to resume), None when there is none."""

    @abstractmethod
    def start_upload(self, key: str) -> str:
        """Begin a multipart upload whose parts the store checks against their SHA-256."""

    @abstractmethod
    def list_parts(self, key: str, upload_id: str) -> dict[int, StoredPart]:
        """Parts already stored for an unfinished upload, by part number."""

    @abstractmethod
    def part_matches(
        self, key: str, upload_id: str, part: StoredPart, offset: int, data: bytes, sha256: str
    ) -> bool:
        """Whether a stored part holds exactly `data` (whose base64 SHA-256 is `sha256`)."""

    @abstractmethod
    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes, sha256: str,
        source_fd: int | None = None,
    ) -> StoredPart:
        """Store one part at byte `offset` of the object; the store verifies `sha256`.

        `source_fd` is the open source file holding `data` at the same offset; a store may copy
        from it in the kernel instead of from `data`."""

    @abstractmethod
    def complete_upload(
        self, key: str, upload_id: str, parts: list[StoredPart], composite: str
    ) -> None:
        """Commit the parts as the object; raises ChecksumMismatchError unless the store's
        composite checksum equals `composite`."""

    @abstractmethod
    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload and its parts."""
