"""Verify a published version against its manifest: stored sizes and composite checksums
(no download), or in deep mode by streaming every byte and recomputing SHA-256."""

from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ConfigDict, Field

from engine.weights.errors import ChecksumMismatchError
from engine.weights.fetch import REPUBLISH, stored_entry, stream_file
from engine.weights.manifest import Manifest, read_manifest
from engine.weights.progress import ProgressCallback, ProgressReporter
from engine.weights.store import ObjectStore
from engine.weights.urls import open_store


class VerifyReport(BaseModel):
    """A version that passed verification."""

    model_config = ConfigDict(frozen=True)

    url: str = Field(..., description="the version's URL")
    manifest: Manifest = Field(..., description="the manifest checked against")
    deep: bool = Field(..., description="whether every byte was re-hashed")
    files_checked: int = Field(..., ge=0, description="files that matched")
    bytes_read: int = Field(..., ge=0, description="bytes downloaded (deep mode only)")


def verify(
    src: str | ObjectStore,
    *,
    deep: bool = False,
    max_concurrency: int | None = None,
    progress: ProgressCallback | None = None,
    show_progress: bool = False,
) -> VerifyReport:
    """Check every file of the version; raises ManifestMissingError, ObjectMissingError or
    ChecksumMismatchError (naming the file) on the first problem."""
    store = src if isinstance(src, ObjectStore) else open_store(src, max_concurrency=max_concurrency)
    manifest = read_manifest(store)
    for entry in manifest.files:
        stored = stored_entry(store, entry)
        if not deep:
            if stored.sha256 is None:
                raise ChecksumMismatchError(
                    entry.path, "the store holds no SHA-256 for it (not written by a tideflow publish)",
                    "run verify --deep, or republish the version with --force",
                )
            if stored.sha256 != entry.composite or stored.parts not in (None, len(entry.parts)):
                raise ChecksumMismatchError(
                    entry.path, f"stored composite SHA-256 {stored.sha256} != manifest {entry.composite}",
                    REPUBLISH,
                )
    bytes_read = 0
    if deep:
        concurrency = max_concurrency or store.config.max_concurrency
        before = store.counters.bytes_downloaded
        total = sum(f.size for f in manifest.files)
        with ThreadPoolExecutor(concurrency, thread_name_prefix="verify") as pool, \
                ProgressReporter("verify", total, progress, show_progress) as reporter:
            for entry in manifest.files:
                stream_file(store, entry, pool, concurrency, reporter)
        bytes_read = store.counters.bytes_downloaded - before
    return VerifyReport(
        url=store.url, manifest=manifest, deep=deep,
        files_checked=len(manifest.files), bytes_read=bytes_read,
    )
