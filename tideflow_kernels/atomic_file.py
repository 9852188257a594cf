"""Atomic file writes: readers see the old file or the new one, never half of one.

Each write goes through its own temporary name (pid + random), so two threads or two processes
writing the same file never rename each other's temporary away. It lives in the lowest layer
(tideflow_kernels/) because both tideflow_kernels/ and engine/ write files this way.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` atomically; `mode` (e.g. 0o600) is set before the file becomes visible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = os.open(tmp, flags, 0o600 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(tmp, mode)  # the umask may have narrowed it; a key file must not be wider either
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode)
