"""The audit log: every control action and every refused call, append-only, each entry chained to the last.

Each entry records who (the role of the key and its digest, never the key), what (method and path), the
target, the parameters (secrets redacted, a large spec by its digest), the result and the time. Its `hash`
is SHA-256 over its canonical JSON with the previous entry's hash inside, so editing, dropping or reordering
a line breaks the chain from there on, and `tideflow audit --verify` names the first line that does not
follow. A chain proves order and integrity against an editor who cannot also rewrite every later line; an
operator who wants more anchors the head (`tideflow audit --verify` prints it) somewhere the fleet cannot
write, which is why the head is printed, not kept here.

One writer: the controller of the home (the home lock allows one). A write that a crash cut short is cut
off when the log is opened again, and that is itself an entry, so the gap is on record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

log = logging.getLogger(__name__)

AUDIT_FILE = "audit.jsonl"
GENESIS = "0" * 64
MAX_PARAMS_BYTES = 4096  # larger bodies (a whole group spec) are recorded by digest and name
SECRET_NAME = re.compile(r"key|secret|token|password|credential|authorization", re.IGNORECASE)


class AuditEntry(BaseModel):
    seq: int = Field(ge=1, description="position in the chain, from 1")
    at: str = Field(description="UTC time, ISO 8601")
    actor: str = Field(description="role of the key used and its digest (admin:1a2b...), or anonymous")
    action: str = Field(description="what was asked: method and path, or the controller's own action")
    target: str | None = Field(None, description="the group, pool, lease holder or key it acted on")
    params: dict[str, Any] = Field(default_factory=dict, description="the request's parameters, secrets redacted")
    result: str = Field(description="ok, refused (401/403), rejected (another 4xx) or failed (5xx)")
    status: int = Field(description="HTTP status answered (0 for the controller's own actions)")
    prev: str = Field(description="hash of the entry before (64 zeros for the first)")
    hash: str = Field(description="SHA-256 of this entry's canonical JSON without this field")

    def expected_hash(self) -> str:
        return entry_hash(self.model_dump(exclude={"hash"}))


def entry_hash(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def redact(value: Any) -> Any:
    """The value with every field whose name says secret replaced by "<redacted>"."""
    if isinstance(value, dict):
        return {k: "<redacted>" if SECRET_NAME.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def summarize(params: dict[str, Any]) -> dict[str, Any]:
    """Params as recorded: redacted, and a body too large to keep whole replaced by its digest and its names."""
    clean = redact(params)
    text = json.dumps(clean, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) <= MAX_PARAMS_BYTES:
        return clean
    body = clean.get("body") if isinstance(clean.get("body"), dict) else {}
    names = {k: body[k] for k in ("name", "version") if isinstance(body.get(k), str)}
    return {**{k: v for k, v in clean.items() if k != "body"}, "body": {
        **names, "sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text)}}


class AuditLog:
    """The home's audit log, open for appending; thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seq, self._prev, torn = self._tail()
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        if torn:
            self.record("controller", "audit.recover", None, {"torn_bytes": torn}, "ok", 0)

    def _tail(self) -> tuple[int, str, int]:
        """(last seq, last hash, bytes of a torn last line cut off) of the log as found."""
        if not self.path.exists():
            return 0, GENESIS, 0
        data = self.path.read_bytes()
        torn = 0
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            torn = len(data) - keep
            with open(self.path, "r+b") as f:
                f.truncate(keep)
            data = data[:keep]
        lines = data.splitlines()
        if not lines:
            return 0, GENESIS, torn
        try:
            last = AuditEntry.model_validate_json(lines[-1])
        except ValidationError:
            # an unreadable last line: chain on from it regardless (verify reports the line)
            return len(lines), hashlib.sha256(lines[-1]).hexdigest(), torn
        return last.seq, last.hash, torn

    def record(self, actor: str, action: str, target: str | None, params: dict[str, Any], result: str,
               status: int) -> AuditEntry:
        with self._lock:
            fields = dict(seq=self._seq + 1, at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                          actor=actor, action=action, target=target, params=summarize(params), result=result,
                          status=status, prev=self._prev)
            entry = AuditEntry(**fields, hash=entry_hash(fields))
            line = entry.model_dump_json()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:  # opened per entry: nothing to close, and an entry after the controller stopped still lands
                os.write(fd, (line + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._seq, self._prev = entry.seq, entry.hash
        log.info("audit %s", line)  # also to the controller's log: a cluster's log pipeline keeps a copy
        return entry


class ChainBreak(BaseModel):
    line: int = Field(description="1-based line of the file")
    why: str


class ChainReport(BaseModel):
    entries: int = Field(description="lines read")
    head: str = Field(description="hash of the last entry (anchor it outside the fleet to prove later lines)")
    breaks: list[ChainBreak] = Field(default_factory=list, description="lines that do not follow the chain")

    @property
    def intact(self) -> bool:
        return not self.breaks


def read_entries(path: Path) -> list[AuditEntry]:
    """Every readable entry, in file order (for listing; `verify` judges them)."""
    out = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(AuditEntry.model_validate_json(raw))
        except ValidationError:
            continue
    return out


def verify(path: Path) -> ChainReport:
    """Check every line: readable, its own hash right, the previous line's hash inside, seq counting up by
    one. A line that breaks the chain is reported and the next one is checked against it as written, so one
    edited line is one break, and a removed or inserted line shows where it was."""
    prev, seq, head, breaks, n = GENESIS, 0, GENESIS, [], 0
    for n, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            entry = AuditEntry.model_validate_json(raw)
        except ValidationError as exc:
            breaks.append(ChainBreak(line=n, why=f"not an audit entry: {exc.errors()[0]['msg']}"))
            prev, seq = hashlib.sha256(raw).hexdigest(), seq + 1
            continue
        if entry.hash != entry.expected_hash():
            breaks.append(ChainBreak(line=n, why=f"seq {entry.seq}: its content does not match its hash (edited)"))
        elif entry.prev != prev:
            breaks.append(ChainBreak(line=n, why=f"seq {entry.seq}: does not follow the line before (a line "
                                                 "removed, inserted or reordered before it)"))
        elif entry.seq != seq + 1:
            breaks.append(ChainBreak(line=n, why=f"seq {entry.seq} after {seq}"))
        prev, seq, head = entry.hash, entry.seq, entry.hash
    return ChainReport(entries=n, head=head, breaks=breaks)
