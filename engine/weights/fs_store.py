"""A directory as an object store (the embedded default), with S3's commit semantics.

Layout under root:
    <prefix><key>                                   committed objects
    .tideflow/meta/<prefix><key>.json               size + composite SHA-256 of each object
    .tideflow/uploads/<key hash>/<upload id>/data   the object being assembled (parts pwrite'd in place)
    .tideflow/uploads/<key hash>/<upload id>/parts/<n>  a part's size + SHA-256, written after its bytes
A part counts as stored only once its record exists, and a commit is a rename, so a killed
publish leaves either a resumable upload or nothing, never a half-written object.
Part bytes are copied from the source file in the kernel (copy_file_range) when it is given;
the publisher has already hashed the same range, and verify --deep / pull re-check it.
"""

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from engine.weights.config import FsStoreConfig
from engine.weights.errors import ChecksumMismatchError, ObjectMissingError, WeightsError
from engine.weights.parts import composite_sha256, sha256_b64
from engine.weights.store import ListedObject, ObjectStore, StoredObject, StoredPart
from tideflow_kernels.atomic_file import atomic_write_bytes


def refuse_symlinks(root: Path, path: Path) -> None:
    """Raise WeightsError when `path` or a directory between `root` and it is a symbolic link."""
    rel = path.relative_to(root)
    at = root
    for part in rel.parts:
        at = at / part
        if at.is_symlink():
            raise WeightsError(f"{at} is a symbolic link: weights stores and caches never follow links")


def _copy_range(src: int, dst: int, offset: int, length: int) -> int:
    """Copy in the kernel (no user-space pass over the bytes); returns how much was copied,
    which may be short when copy_file_range is unsupported here."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src, dst, length - done, offset + done, offset + done)
            if n == 0:
                break
            done += n
    except OSError:
        pass
    return done


class FsStore(ObjectStore):
    """Objects are files below `root/prefix`; uploads are staged under `root/.tideflow`."""

    def __init__(self, config: FsStoreConfig):
        super().__init__(config, config.url)
        self.root = config.root
        self.prefix = config.prefix

    def _object(self, key: str) -> Path:
        """The object's file; a symlink anywhere below the root is refused, never followed (it could copy
        a file from outside the store into a cache that is then marked verified)."""
        path = self.root / (self.prefix + key)
        refuse_symlinks(self.root, path)
        return path

    def _meta(self, key: str) -> Path:
        return self.root / ".tideflow" / "meta" / (self.prefix + key + ".json")

    def _uploads(self, key: str) -> Path:
        digest = hashlib.sha256((self.prefix + key).encode()).hexdigest()[:32]
        return self.root / ".tideflow" / "uploads" / digest

    def head(self, key: str) -> StoredObject | None:
        try:
            size = self._object(key).stat().st_size
        except FileNotFoundError:
            return None
        try:
            meta = json.loads(self._meta(key).read_bytes())
        except (FileNotFoundError, ValueError):
            return StoredObject(size=size, sha256=None, parts=None)
        if meta.get("size") != size:
            return StoredObject(size=size, sha256=None, parts=None)
        return StoredObject(size=size, sha256=meta["sha256"], parts=meta["parts"])

    def read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            fd = os.open(self._object(key), os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectMissingError(self.url, key) from None
        try:
            data = os.pread(fd, length, start)
        finally:
            os.close(fd)
        self.counters.downloaded(len(data))
        return data

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return self._object(key).read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, key: str, data: bytes) -> None:
        atomic_write_bytes(self._object(key), data)

    def delete(self, key: str) -> None:
        self._meta(key).unlink(missing_ok=True)
        self._object(key).unlink(missing_ok=True)

    def list_objects(self, prefix: str) -> Iterator[ListedObject]:
        base = self.root / self.prefix
        start = base / prefix if prefix.endswith("/") else (base / prefix).parent
        if not start.is_dir() or start.is_symlink():
            return
        for folder, dirs, files in os.walk(start):
            dirs[:] = [d for d in dirs if not (d == ".tideflow" and Path(folder) == self.root)]
            for name in files:
                path = Path(folder) / name
                key = path.relative_to(base).as_posix()
                if not key.startswith(prefix) or path.is_symlink():
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:  # deleted while listed
                    continue
                yield ListedObject(key, st.st_size, st.st_mtime)

    def expire_prefix(self, prefix: str, days: int) -> bool:
        return False

    def open_upload(self, key: str) -> str | None:
        base = self._uploads(key)
        if not base.is_dir():
            return None
        candidates = [p for p in base.iterdir() if (p / "data").is_file()]
        if not candidates:
            return None
        return max(candidates, key=lambda p: p.stat().st_mtime_ns).name

    def start_upload(self, key: str) -> str:
        upload_id = uuid.uuid4().hex
        staging = self._uploads(key) / upload_id
        (staging / "parts").mkdir(parents=True)
        (staging / "data").touch()
        return upload_id

    def list_parts(self, key: str, upload_id: str) -> dict[int, StoredPart]:
        found: dict[int, StoredPart] = {}
        parts_dir = self._uploads(key) / upload_id / "parts"
        for record in parts_dir.glob("[0-9]*"):
            info = json.loads(record.read_bytes())
            number = int(record.name)
            found[number] = StoredPart(number=number, size=info["size"], sha256=info["sha256"])
        return found

    def part_matches(
        self, key: str, upload_id: str, part: StoredPart, offset: int, data: bytes, sha256: str
    ) -> bool:
        if part.size != len(data) or part.sha256 != sha256:
            return False
        # Re-read the staged bytes: a part is reused only if what is on disk still hashes right.
        fd = os.open(self._uploads(key) / upload_id / "data", os.O_RDONLY)
        try:
            return sha256_b64(os.pread(fd, part.size, offset)) == sha256
        finally:
            os.close(fd)

    def upload_part(
        self, key: str, upload_id: str, number: int, offset: int, data: bytes, sha256: str,
        source_fd: int | None = None,
    ) -> StoredPart:
        staging = self._uploads(key) / upload_id
        fd = os.open(staging / "data", os.O_WRONLY)
        try:
            done = _copy_range(source_fd, fd, offset, len(data)) if source_fd is not None else 0
            view = memoryview(data)[done:]
            at = offset + done
            while view:
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
        finally:
            os.close(fd)
        # The record is the part's commit: written only after all its bytes are in the file.
        atomic_write_bytes(staging / "parts" / str(number), json.dumps({"size": len(data), "sha256": sha256}).encode())
        self.counters.uploaded(len(data))
        return StoredPart(number=number, size=len(data), sha256=sha256)

    def complete_upload(
        self, key: str, upload_id: str, parts: list[StoredPart], composite: str
    ) -> None:
        staging = self._uploads(key) / upload_id
        recorded = self.list_parts(key, upload_id)
        for part in parts:
            if recorded.get(part.number) != part:
                raise ChecksumMismatchError(
                    key, f"part {part.number} is not staged as expected in {self.url}",
                    "publish again to re-send it",
                )
        size = sum(p.size for p in parts)
        data = staging / "data"
        os.truncate(data, size)
        stored = composite_sha256(r.sha256 for r in (recorded[p.number] for p in parts))
        if stored != composite:
            raise ChecksumMismatchError(
                key, f"stored composite SHA-256 {stored} != expected {composite}", "publish again"
            )
        target = self._object(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._meta(key).unlink(missing_ok=True)
        os.replace(data, target)
        atomic_write_bytes(self._meta(key), json.dumps({"size": size, "sha256": stored, "parts": len(parts)}).encode())
        shutil.rmtree(staging, ignore_errors=True)
        for other in self._uploads(key).glob("*"):
            shutil.rmtree(other, ignore_errors=True)

    def abort_upload(self, key: str, upload_id: str) -> None:
        shutil.rmtree(self._uploads(key) / upload_id, ignore_errors=True)
