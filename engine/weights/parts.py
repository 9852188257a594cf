"""Part arithmetic, checksum encodings and the bounded in-order parallel pipeline."""

import base64
import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each part; an empty file is one empty part (S3 needs one part)."""
    if size == 0:
        return [(0, 0)]
    return [(off, min(part_size, size - off)) for off in range(0, size, part_size)]


def sha256_b64(data: bytes | memoryview) -> str:
    """Base64 SHA-256, the encoding S3 uses for ChecksumSHA256."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def composite_sha256(part_digests: Iterable[str]) -> str:
    """S3's composite checksum of a multipart object: sha256 over the concatenated part digests."""
    joined = b"".join(base64.b64decode(d) for d in part_digests)
    return sha256_b64(joined)


def strip_part_count(checksum: str) -> tuple[str, int | None]:
    """Split S3's 'digest-N' composite form into (digest, N)."""
    digest, sep, count = checksum.partition("-")
    return digest, (int(count) if sep and count.isdigit() else None)


def run_ordered(
    pool: ThreadPoolExecutor, jobs: Iterable[Callable[[], T]], window: int
) -> Iterator[T]:
    """Run jobs on the pool with at most `window` in flight; yield results in submission order.

    The jobs iterable is advanced on the caller's thread, so reading and whole-file hashing
    stay sequential while per-part work (hashing, network, disk) overlaps on the pool.
    """
    pending: deque[Future[T]] = deque()
    try:
        for job in jobs:
            pending.append(pool.submit(job))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()
        for fut in pending:
            if not fut.cancelled():
                fut.exception()
