"""Names of KV blocks outside the device pool, and the checksummed record each block is kept as.

A block inside a member is named by its chained hash (engine.core.kv_cache.block_hash: the parent's hash and the
block's token ids, plus a request's cache_salt folded into the first block). Outside, the same hash is kept under a
namespace that adds what the tokens do not say: the model and weights version, the dtype, the block size and the
cache layout. A canary's blocks then never answer a stable member's lookup, and a block written by a build with
another layout is never read into this one.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"TFKV\x01"
_HEADER = struct.Struct("<5s16sQI")  # magic, name digest, payload length, CRC-32 of the payload
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class CorruptBlock(Exception):
    """A kept block whose bytes are not what was written: it is recomputed, never read into the cache."""


def _component(text: str) -> str:
    """A path component made of safe characters (model ids hold '/'), never empty."""
    return _UNSAFE.sub("_", text) or "_"


@dataclass(frozen=True)
class KVNamespace:
    """Where one member's blocks live in every tier: `kv/<model>/<version>/<salt>/<hash>`."""

    model: str
    version: str
    salt: str  # hex digest of dtype, block size, cache layout and the weights' identity

    @classmethod
    def of(cls, model: str, version: str, *, dtype: str, block_size: int, layout: tuple[int, ...],
           weights_id: str) -> "KVNamespace":
        h = hashlib.blake2b(digest_size=12)
        for part in (dtype, str(block_size), ",".join(map(str, layout)), weights_id):
            h.update(part.encode())
            h.update(b"\x00")
        return cls(model, version or "unversioned", h.hexdigest())

    @property
    def prefix(self) -> str:
        """Every key of this namespace starts here; removing it removes the version's KV."""
        return version_prefix(self.model, self.version) + self.salt + "/"

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"


def version_prefix(model: str, version: str) -> str:
    """The keys of one model version, whatever its dtype or layout (the pipeline removes a retired version's)."""
    return f"kv/{_component(model)}/{_component(version or 'unversioned')}/"


def encode(key: str, payload: bytes | memoryview) -> bytes:
    """A block as kept: a header naming it and holding its length and checksum, then its K and V bytes.

    The checksum is a CRC-32: it is there for torn writes and flipped bits, not for an attacker (who could write
    any block to the store anyway), and it costs 0.17 ms a 256 KiB block where BLAKE2b-128 costs 0.62 ms
    (benchmarks/kv_block_io.py)."""
    name = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return _HEADER.pack(MAGIC, name, len(payload), zlib.crc32(payload)) + bytes(payload)


def decode(key: str, record: bytes, payload_bytes: int) -> memoryview:
    """The payload of `record` if it is whole and is the block `key` names; CorruptBlock otherwise."""
    if len(record) < _HEADER.size:
        raise CorruptBlock(f"{key}: {len(record)} bytes, shorter than a header")
    magic, name, length, checksum = _HEADER.unpack_from(record)
    if magic != MAGIC:
        raise CorruptBlock(f"{key}: not a KV block record")
    if name != hashlib.blake2b(key.encode(), digest_size=16).digest():
        raise CorruptBlock(f"{key}: the record names another block")
    payload = memoryview(record)[_HEADER.size:]
    if length != payload_bytes or len(payload) != payload_bytes:
        raise CorruptBlock(f"{key}: {len(payload)} payload bytes, {payload_bytes} expected")
    if zlib.crc32(payload) != checksum:
        raise CorruptBlock(f"{key}: checksum mismatch")
    return payload
