"""Publish a checkpoint directory as a version: one read per file, parallel verified parts,
manifest written last as the commit marker.

Per file the bytes are read once on the calling thread, which feeds the whole-file SHA-256;
each part then goes to a worker that computes its own SHA-256 and uploads it (or keeps the
identical part an interrupted publish already stored). Files already stored with the same
composite checksum are only hashed, never re-sent.
"""

import hashlib
import os
from contextlib import closing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engine.weights.config import MiB
from engine.weights.errors import ManifestInvalidError, ManifestMissingError, VersionConflictError, WeightsError
from engine.weights.manifest import MANIFEST_NAME, Manifest, ManifestFile, read_manifest
from engine.weights.parts import part_ranges, run_ordered, sha256_b64
from engine.weights.progress import ProgressCallback, ProgressReporter
from engine.weights.store import ObjectStore, StoredPart
from engine.weights.urls import open_store

MAX_PARTS = 10_000  # S3's limit on parts per upload
CACHE_NAMES = (".tideflow-verified.json", ".tideflow.lock")  # a pulled cache's bookkeeping


class PublishReport(BaseModel):
    """What a publish did."""

    model_config = ConfigDict(frozen=True)

    url: str = Field(..., description="the version's URL")
    manifest: Manifest = Field(..., description="the committed manifest")
    parts_uploaded: int = Field(..., ge=0, description="parts sent to the store")
    parts_reused: int = Field(..., ge=0, description="parts of an interrupted publish kept as stored")
    files_unchanged: int = Field(..., ge=0, description="files already stored with identical content")
    bytes_uploaded: int = Field(..., ge=0, description="bytes sent to the store")
    manifest_written: bool = Field(..., description="False when the version was already identical")


def source_files(src: Path) -> list[str]:
    """Relative paths of the files to publish, sorted; a pulled cache's bookkeeping is skipped."""
    if not src.is_dir():
        raise WeightsError(f"{src} is not a directory; pass the checkpoint directory to publish")
    found = []
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d != ".tideflow")
        for name in dirnames + filenames:
            _refuse_link(Path(dirpath) / name)
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(src).as_posix()
            if name in CACHE_NAMES or name.endswith(".tideflow-partial"):
                continue
            if rel == MANIFEST_NAME:
                _reject_foreign_manifest(src / rel)
                continue
            found.append(rel)
    if not found:
        raise WeightsError(f"{src} holds no files to publish")
    return sorted(found)


def _refuse_link(path: Path) -> None:
    """A link in a checkpoint could publish any file of this host into the store (a tokenizer.json
    pointing at a key file), so publishing never follows one; the caller resolves them on purpose."""
    if path.is_symlink():
        raise WeightsError(
            f"{path} is a symbolic link (to {os.readlink(path)}): publish never follows links; copy the "
            f"checkpoint with its links resolved (`cp -rL SRC DIR`, e.g. from a Hugging Face cache) and publish that"
        )


def _reject_foreign_manifest(path: Path) -> None:
    try:
        Manifest.parse(path.read_bytes(), str(path))
    except ManifestInvalidError:
        raise WeightsError(
            f"{path}: manifest.json is reserved for the tideflow manifest; rename that file"
        ) from None


def file_part_size(size: int, part_size: int) -> int:
    """The requested part size, grown (in whole MiB) when a file would need over 10,000 parts."""
    needed = -(-size // MAX_PARTS)
    return max(part_size, -(-needed // MiB) * MiB)


def _read_into(f, buf: bytearray, path: Path) -> None:
    view = memoryview(buf)
    while view:
        n = f.readinto(view)
        if not n:
            raise WeightsError(f"{path} shrank while being published; publish again once it is stable")
        view = view[n:]


@dataclass
class _Run:
    """State shared by the files of one publish."""

    store: ObjectStore
    src: Path
    part_size: int
    pool: ThreadPoolExecutor
    window: int
    reporter: ProgressReporter
    previous: Manifest | None
    force: bool
    parts_uploaded: int = 0
    parts_reused: int = 0
    files_unchanged: int = 0
    bytes_uploaded: int = 0
    manifest_dropped: bool = False
    files: list[ManifestFile] = field(default_factory=list)

    def before_first_write(self) -> None:
        """A forced overwrite retracts the old manifest first, so readers never mix versions."""
        if self.previous is not None and not self.manifest_dropped:
            self.store.delete(MANIFEST_NAME)
            self.manifest_dropped = True

    def stream(self, rel: str, size: int, part_size: int, part_job, *, on_result):
        """Read the file once, hash it whole here and run `part_job` per part on the pool.

        `on_result(count, result)` sees each part's result in order and returns True to stop;
        returns the results and the hex SHA-256 (None when stopped early).
        """
        path = self.src / rel
        whole = hashlib.sha256()
        # Full-size part buffers are recycled once their part is done: fresh 64 MiB allocations
        # would page-fault on every part and cost more than the hashing.
        free: list[bytearray] = []

        # O_NOFOLLOW: a file swapped for a link after source_files looked is refused, not followed
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as f:
            fd = f.fileno()

            def jobs():
                for number, (offset, length) in enumerate(part_ranges(size, part_size), 1):
                    buf = free.pop() if length == part_size and free else bytearray(length)
                    _read_into(f, buf, path)
                    whole.update(buf)
                    yield lambda n=number, o=offset, d=buf: (d, part_job(n, o, d, fd))
                if f.read(1):
                    raise WeightsError(f"{path} grew while being published; publish again once it is stable")

            results = []
            # closing() waits for parts still in flight before the file (and fd) is closed.
            with closing(run_ordered(self.pool, jobs(), self.window)) as done:
                for buf, result in done:
                    results.append(result)
                    if len(buf) == part_size:
                        free.append(buf)
                    if on_result(len(results), result):
                        return results, None
        return results, whole.hexdigest()


def _hash_only(run: _Run, rel: str, size: int, part_size: int, reference: list[str] | None):
    """Hash a file without sending it; stop at the first part that differs from `reference`."""

    def part_job(number: int, offset: int, data: bytes, source_fd: int) -> tuple[str, int]:
        return sha256_b64(data), len(data)

    def differs(count: int, result: tuple[str, int]) -> bool:
        digest, nbytes = result
        if reference is not None and reference[count - 1] != digest:
            return True
        run.reporter.part(rel, nbytes, sent=False)
        return False

    results, sha = run.stream(rel, size, part_size, part_job, on_result=differs)
    if sha is None:
        return None
    return ManifestFile(path=rel, size=size, sha256=sha, part_size=part_size, parts=[d for d, _ in results])


def _upload(run: _Run, rel: str, size: int, part_size: int) -> ManifestFile:
    """Send a file as a multipart upload, resuming the open upload of an interrupted publish."""
    store = run.store
    upload_id = store.open_upload(rel)
    stored = store.list_parts(rel, upload_id) if upload_id else {}
    if upload_id is None:
        upload_id = store.start_upload(rel)

    def part_job(number: int, offset: int, data: bytes, source_fd: int) -> tuple[StoredPart, bool]:
        digest = sha256_b64(data)
        old = stored.get(number)
        if old is not None and store.part_matches(rel, upload_id, old, offset, data, digest):
            return StoredPart(number=number, size=len(data), sha256=digest, etag=old.etag), False
        return store.upload_part(rel, upload_id, number, offset, data, digest, source_fd), True

    def tally(count: int, result: tuple[StoredPart, bool]) -> bool:
        part, sent = result
        if sent:
            run.parts_uploaded += 1
            run.bytes_uploaded += part.size
        else:
            run.parts_reused += 1
        run.reporter.part(rel, part.size, sent=sent)
        return False

    results, sha = run.stream(rel, size, part_size, part_job, on_result=tally)
    parts = [part for part, _ in results]
    entry = ManifestFile(path=rel, size=size, sha256=sha, part_size=part_size, parts=[p.sha256 for p in parts])
    store.complete_upload(rel, upload_id, parts, entry.composite)
    return entry


def _publish_file(run: _Run, rel: str) -> ManifestFile:
    size = (run.src / rel).stat().st_size
    part_size = file_part_size(size, run.part_size)
    before = run.previous.file(rel) if run.previous else None
    if before is not None and not run.force:
        if before.size != size:
            raise VersionConflictError(run.store.url, rel, f"size {size} vs published {before.size}")
        if before.part_size != part_size:
            raise VersionConflictError(
                run.store.url, rel, f"published with {before.part_size}-byte parts, not {part_size}"
            )
    obj = run.store.head(rel)
    obj_ok = obj is not None and obj.size == size and obj.sha256 is not None
    if before is not None or obj_ok:
        comparable = before is not None and before.size == size and before.part_size == part_size
        done_before = run.reporter.bytes_done
        entry = _hash_only(run, rel, size, part_size, before.parts if comparable else None)
        same_as_before = entry is not None and (before is None or entry == before)
        if not same_as_before and before is not None and not run.force:
            raise VersionConflictError(run.store.url, rel, "its bytes differ from the published SHA-256")
        if entry is not None and obj_ok and obj.sha256 == entry.composite:
            run.files_unchanged += 1
            return entry
        # The file is read a second time, to send it: count what the hash pass covered twice.
        run.reporter.bytes_total += run.reporter.bytes_done - done_before
        run.reporter.bar.total = run.reporter.bytes_total
    run.before_first_write()
    return _upload(run, rel, size, part_size)


def publish(
    src: str | Path,
    dest: str | ObjectStore,
    *,
    force: bool = False,
    part_size: int | None = None,
    max_concurrency: int | None = None,
    progress: ProgressCallback | None = None,
    show_progress: bool = False,
) -> PublishReport:
    """Publish the files of `src` as the version at `dest` (a URL or an open store).

    Identical content uploads nothing; an interrupted publish resumes from its stored parts;
    a version that exists with other content raises VersionConflictError unless `force`.
    """
    src = Path(src)
    store = dest if isinstance(dest, ObjectStore) else open_store(
        dest, part_size=part_size, max_concurrency=max_concurrency
    )
    rels = source_files(src)
    try:
        previous = read_manifest(store)
    except ManifestMissingError:
        previous = None
    except ManifestInvalidError:
        if not force:
            raise
        previous = None
    if previous is not None and not force:
        missing = sorted(set(f.path for f in previous.files) ^ set(rels))
        if missing:
            raise VersionConflictError(store.url, missing[0], "the set of files differs")
    chosen = part_size or store.config.part_size
    if previous is not None and not force and part_size is None:
        chosen = previous.part_size  # keep the published layout so identical bytes compare equal
    total = sum((src / r).stat().st_size for r in rels)
    concurrency = max_concurrency or store.config.max_concurrency
    with ThreadPoolExecutor(concurrency, thread_name_prefix="publish") as pool, \
            ProgressReporter("publish", total, progress, show_progress) as reporter:
        run = _Run(store=store, src=src, part_size=chosen, pool=pool, window=concurrency,
                   reporter=reporter, previous=previous, force=force)
        run.files = [_publish_file(run, rel) for rel in rels]
    config = next((f for f in run.files if f.path == "config.json"), None)
    manifest = Manifest(part_size=chosen, config_sha256=config.sha256 if config else None, files=run.files)
    unchanged = previous is not None and not run.manifest_dropped and previous.same_content(manifest)
    if not unchanged:
        store.write_bytes(MANIFEST_NAME, manifest.to_bytes())
    return PublishReport(
        url=store.url, manifest=previous if unchanged else manifest,
        parts_uploaded=run.parts_uploaded, parts_reused=run.parts_reused,
        files_unchanged=run.files_unchanged, bytes_uploaded=run.bytes_uploaded,
        manifest_written=not unchanged,
    )
