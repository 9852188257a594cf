"""Read a stored file as parallel ranged GETs, checking every part and the whole file."""

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.weights.errors import ChecksumMismatchError, ObjectMissingError
from engine.weights.manifest import ManifestFile
from engine.weights.parts import part_ranges, run_ordered, sha256_b64
from engine.weights.progress import ProgressReporter
from engine.weights.store import ObjectStore, StoredObject

REPUBLISH = "the stored copy is corrupt: republish the version with --force"


def stored_entry(store: ObjectStore, entry: ManifestFile) -> StoredObject:
    """The stored object behind a manifest entry, present and of the manifest's size: the check that pull
    and verify both make before trusting (or fetching) a file; raises ObjectMissingError or
    ChecksumMismatchError naming the file."""
    stored = store.head(entry.path)
    if stored is None:
        raise ObjectMissingError(store.url, entry.path)
    if stored.size != entry.size:
        raise ChecksumMismatchError(entry.path, f"stored size {stored.size} != manifest size {entry.size}", REPUBLISH)
    return stored


def stream_file(
    store: ObjectStore,
    entry: ManifestFile,
    pool: ThreadPoolExecutor,
    window: int,
    reporter: ProgressReporter,
    sink: Callable[[int, bytes], None] | None = None,
) -> None:
    """Fetch `entry` part by part (each checked against its SHA-256 on a worker, then passed
    to `sink(offset, data)`), hash the whole file in order here, and raise
    ChecksumMismatchError naming the file on any difference."""

    def job(number: int, offset: int, length: int) -> bytes:
        data = store.read_range(entry.path, offset, length)
        if len(data) != length:
            raise ChecksumMismatchError(
                entry.path, f"part {number} has {len(data)} bytes, {length} expected", REPUBLISH
            )
        if sha256_b64(data) != entry.parts[number - 1]:
            raise ChecksumMismatchError(
                entry.path, f"part {number} (bytes {offset}..{offset + length}) does not match "
                f"its SHA-256 in the manifest", REPUBLISH,
            )
        if sink is not None:
            sink(offset, data)
        return data

    jobs = (
        (lambda n=n, o=o, ln=ln: job(n, o, ln))
        for n, (o, ln) in enumerate(part_ranges(entry.size, entry.part_size), 1)
    )
    whole = hashlib.sha256()
    for data in run_ordered(pool, jobs, window):
        whole.update(data)
        reporter.part(entry.path, len(data), sent=True)
    if whole.hexdigest() != entry.sha256:
        raise ChecksumMismatchError(entry.path, "the whole-file SHA-256 differs from the manifest", REPUBLISH)
