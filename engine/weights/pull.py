"""Distribute a version into a node-local cache, and the gate the engine loads weights through.

A cache directory holds the files, the version's manifest.json and a verification marker
(the manifest digest plus each file's size and mtime). A matching marker makes a pull a
no-op after a cheap re-stat; anything else is re-checked, and what does not hash right is
fetched again into a partial file and renamed into place. An flock on the directory
serialises concurrent pulls, so two processes leave one correct cache.
"""

import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.weights.errors import UnverifiedWeightsError, WeightsError
from engine.weights.fetch import stored_entry, stream_file
from engine.weights.manifest import MANIFEST_NAME, Manifest, ManifestFile, read_manifest
from engine.weights.progress import ProgressCallback, ProgressReporter
from engine.weights.store import ObjectStore
from engine.runtime.paths import home
from engine.weights.urls import open_store

MARKER_NAME = ".tideflow-verified.json"
LOCK_NAME = ".tideflow.lock"
PARTIAL_SUFFIX = ".tideflow-partial"
_HASH_CHUNK = 8 << 20


class VerificationMarker(BaseModel):
    """Written after every file of a cache matched its manifest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest_sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="digest of the cached manifest")
    files: dict[str, tuple[int, int]] = Field(..., description="path -> (size, mtime_ns) when verified")


class PullReport(BaseModel):
    """What a pull did."""

    model_config = ConfigDict(frozen=True)

    url: str = Field(..., description="the version's URL")
    cache_dir: str = Field(..., description="the node-local cache")
    manifest: Manifest = Field(..., description="the version's manifest")
    noop: bool = Field(..., description="the cache was already verified for this manifest")
    files_fetched: int = Field(..., ge=0, description="files downloaded")
    files_kept: int = Field(..., ge=0, description="cached files that already matched")
    bytes_fetched: int = Field(..., ge=0, description="bytes downloaded")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    with open(cache / LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def require_verified(directory: str | Path, *, deep: bool = False) -> Manifest:
    """The manifest of a verified cache; raises UnverifiedWeightsError otherwise.

    The cheap check compares each file's size and mtime with the verification marker;
    `deep` also re-hashes every file.
    """
    d = Path(directory)
    try:
        manifest = Manifest.parse((d / MANIFEST_NAME).read_bytes(), str(d))
    except FileNotFoundError:
        raise UnverifiedWeightsError(str(d), "no manifest.json") from None
    except WeightsError as e:
        raise UnverifiedWeightsError(str(d), str(e)) from None
    try:
        marker = VerificationMarker.model_validate_json((d / MARKER_NAME).read_bytes())
    except (FileNotFoundError, ValidationError):
        raise UnverifiedWeightsError(str(d), "no valid verification marker: a pull never finished here") from None
    if marker.manifest_sha256 != manifest.digest:
        raise UnverifiedWeightsError(str(d), "the marker was written for another manifest")
    extra = _unlisted(d, manifest)
    if extra:
        raise UnverifiedWeightsError(str(d), f"{extra[0]} is not in the manifest (a verified cache holds exactly "
                                             f"its manifest's files; `tideflow weights pull` removes others)")
    for entry in manifest.files:
        try:
            seen = _stat(d / entry.path)
        except FileNotFoundError:
            raise UnverifiedWeightsError(str(d), f"{entry.path} is missing") from None
        if seen != marker.files.get(entry.path):
            raise UnverifiedWeightsError(str(d), f"{entry.path} changed since it was verified")
        if deep and file_sha256(d / entry.path) != entry.sha256:
            raise UnverifiedWeightsError(str(d), f"{entry.path} does not match its SHA-256")
    return manifest


_OWN_FILES = {MANIFEST_NAME, MARKER_NAME, LOCK_NAME}


def _unlisted(cache: Path, manifest: Manifest) -> list[str]:
    """Entries of the cache that its manifest does not list (symlinks included, never followed), sorted."""
    listed = {e.path for e in manifest.files}
    dirs = {str(Path(p).parent) for p in listed}
    dirs |= {str(parent) for p in listed for parent in Path(p).parents}
    out = []
    for root, subdirs, files in os.walk(cache, followlinks=False):
        for name in subdirs + files:
            rel = os.path.relpath(os.path.join(root, name), cache)
            if rel in _OWN_FILES or rel in listed and not os.path.islink(os.path.join(root, name)):
                continue
            if name in subdirs and rel in dirs and not os.path.islink(os.path.join(root, name)):
                continue
            out.append(rel)
    return sorted(out)


def _remove_unlisted(cache: Path, manifest: Manifest) -> None:
    """Files of an older version (and anything else the manifest does not list) leave the cache."""
    for rel in reversed(_unlisted(cache, manifest)):  # deepest first
        path = cache / rel
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)


def _cached_ok(cache: Path, manifest: Manifest) -> bool:
    try:
        return require_verified(cache).digest == manifest.digest
    except UnverifiedWeightsError:
        return False


def _fetch(store: ObjectStore, entry: ManifestFile, dest: Path, pool: ThreadPoolExecutor,
           window: int, reporter: ProgressReporter) -> None:
    """Download into a partial file, check it, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def sink(offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    try:
        os.ftruncate(fd, entry.size)
        stream_file(store, entry, pool, window, reporter, sink)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(partial, dest)


def pull(
    src: str | ObjectStore,
    cache_dir: str | Path,
    *,
    max_concurrency: int | None = None,
    progress: ProgressCallback | None = None,
    show_progress: bool = False,
) -> PullReport:
    """Make `cache_dir` a verified copy of the version at `src` (a URL or an open store)."""
    store = src if isinstance(src, ObjectStore) else open_store(src, max_concurrency=max_concurrency)
    manifest = read_manifest(store)
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache):
        if _cached_ok(cache, manifest):
            return PullReport(url=store.url, cache_dir=str(cache), manifest=manifest, noop=True,
                              files_fetched=0, files_kept=len(manifest.files), bytes_fetched=0)
        (cache / MARKER_NAME).unlink(missing_ok=True)
        _remove_unlisted(cache, manifest)  # partial files, an older version's files, links: none stays or is followed
        wanted = []
        for entry in manifest.files:
            dest = cache / entry.path
            if dest.is_file() and dest.stat().st_size == entry.size and file_sha256(dest) == entry.sha256:
                continue
            stored_entry(store, entry)  # missing or resized in the store: refused before any byte is fetched
            wanted.append(entry)
        concurrency = max_concurrency or store.config.max_concurrency
        before = store.counters.bytes_downloaded
        with ThreadPoolExecutor(concurrency, thread_name_prefix="pull") as pool, \
                ProgressReporter("pull", sum(e.size for e in wanted), progress, show_progress) as reporter:
            for entry in wanted:
                _fetch(store, entry, cache / entry.path, pool, concurrency, reporter)
        _atomic_write(cache / MANIFEST_NAME, manifest.to_bytes())
        marker = VerificationMarker(
            manifest_sha256=manifest.digest,
            files={e.path: _stat(cache / e.path) for e in manifest.files},
        )
        _atomic_write(cache / MARKER_NAME, marker.model_dump_json().encode())
        return PullReport(
            url=store.url, cache_dir=str(cache), manifest=manifest, noop=False,
            files_fetched=len(wanted), files_kept=len(manifest.files) - len(wanted),
            bytes_fetched=store.counters.bytes_downloaded - before,
        )


def cache_dir_for(url: str) -> Path:
    """The node-local cache directory of a published version ($TIDEFLOW_HOME/cache/weights/<hash of url>)."""
    return home() / "cache" / "weights" / hashlib.sha256(url.encode()).hexdigest()[:16]


def local_model_dir(model: str, show_progress: bool = False) -> Path:
    """A checkpoint directory for `model`: a plain path as given, or a published version's URL pulled
    (verified) into the node cache first."""
    if "://" not in model:
        return Path(model)
    cache = cache_dir_for(model)
    pull(model, cache, show_progress=show_progress)
    return cache
