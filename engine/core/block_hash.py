"""The prefix hash chain that names a KV block by every token before it: one function for the engine's prefix cache,
the router's KV index, KV events and the KV tiers, so all of them agree across processes. No torch: the router
hashes prompts without loading it."""

from __future__ import annotations

import hashlib
from array import array


def block_hash(prev: int | None, tokens: list[int], extra: bytes = b"") -> int:
    """Stable across processes (the PD transfer matches hashes between instances).

    `extra` names what the token ids do not: the images whose placeholder tokens the block holds.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((prev if prev is not None else 0).to_bytes(8, "little", signed=False))
    h.update(b"\x01" if prev is not None else b"\x00")
    h.update(array("q", tokens).tobytes())  # int64, this host's byte order (every host we run on: little-endian)
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def chain_hashes(tokens: list[int], block_size: int, extras: dict[int, bytes], prev: int | None, start: int,
                 stop: int) -> list[int]:
    """The hashes of full blocks [start, stop) of `tokens`, block `start - 1` hashing to `prev`."""
    hashes = []
    for i in range(start, stop):
        prev = block_hash(prev, tokens[i * block_size : (i + 1) * block_size], extras.get(i, b""))
        hashes.append(prev)
    return hashes
