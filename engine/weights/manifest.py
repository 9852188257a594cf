"""The manifest: the commit marker of a published version and the contract pulls check against.

It is deterministic (no timestamps), so identical content always yields the same digest; the
digest keys the verification marker of a node cache.
"""

import hashlib
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.weights.errors import ManifestInvalidError, ManifestMissingError
from engine.weights.parts import composite_sha256, part_ranges
from engine.weights.store import ObjectStore

MANIFEST_NAME = "manifest.json"
_B64_SHA256 = re.compile(r"^[A-Za-z0-9+/]{43}=$")


def tool_version() -> str:
    """The installed tideflow version, recorded in every manifest."""
    try:
        return version("tideflow")
    except PackageNotFoundError:
        return "source"


class ManifestFile(BaseModel):
    """One file of a version: size, whole-file SHA-256 and the SHA-256 of each part."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(..., min_length=1, description="relative POSIX path inside the version")
    size: int = Field(..., ge=0, description="bytes")
    sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of the whole file")
    part_size: int = Field(..., gt=0, description="bytes per part this file was uploaded with")
    parts: list[str] = Field(..., min_length=1, description="base64 SHA-256 of each part, in order")

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        segments = v.split("/")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
            raise ValueError(f"path {v!r} contains a control character")
        if v.startswith("/") or any(s in ("", ".", "..") for s in segments) or "\\" in v:
            raise ValueError(f"path {v!r} must be relative, '/'-separated, without '.' or '..'")
        return v

    @field_validator("parts")
    @classmethod
    def _b64(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not _B64_SHA256.match(p)]
        if bad:
            raise ValueError(f"part checksum {bad[0]!r} is not a base64 SHA-256")
        return v

    @model_validator(mode="after")
    def _part_count(self) -> "ManifestFile":
        expected = len(part_ranges(self.size, self.part_size))
        if len(self.parts) != expected:
            raise ValueError(f"{self.path}: {len(self.parts)} part checksums, {expected} parts expected")
        return self

    @property
    def composite(self) -> str:
        """The composite checksum the store holds for this file."""
        return composite_sha256(self.parts)


class Manifest(BaseModel):
    """A published version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = Field(1, description="manifest schema version")
    tool_version: str = Field(default_factory=tool_version, description="tideflow version that published")
    part_size: int = Field(..., gt=0, description="part size requested at publish")
    config_sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="hex SHA-256 of config.json (the model config), if present"
    )
    files: list[ManifestFile] = Field(..., description="every file of the version, sorted by path")

    @field_validator("files")
    @classmethod
    def _unique_sorted(cls, v: list[ManifestFile]) -> list[ManifestFile]:
        paths = [f.path for f in v]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate file paths")
        for p in paths:
            name = p.rsplit("/", 1)[-1]
            if p == MANIFEST_NAME or name.startswith(".tideflow") or name.endswith(".tideflow-partial"):
                raise ValueError(f"{p}: the name is reserved for the cache's own files ({MANIFEST_NAME}, .tideflow*)")
        return sorted(v, key=lambda f: f.path)

    def to_bytes(self) -> bytes:
        return (self.model_dump_json(indent=2) + "\n").encode()

    @property
    def digest(self) -> str:
        """Hex SHA-256 of the manifest bytes."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def same_content(self, other: "Manifest") -> bool:
        """Same files and bytes, whatever tool published them."""
        return self.files == other.files and self.config_sha256 == other.config_sha256

    def file(self, path: str) -> ManifestFile | None:
        return next((f for f in self.files if f.path == path), None)

    @classmethod
    def parse(cls, data: bytes, where: str) -> "Manifest":
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"]) or "document"
            raise ManifestInvalidError(where, f"{loc}: {first['msg']}") from None


def read_manifest(store: ObjectStore) -> Manifest:
    """The committed manifest of the store's version (ManifestMissingError when not published)."""
    data = store.read_bytes(MANIFEST_NAME)
    if data is None:
        raise ManifestMissingError(store.url)
    return Manifest.parse(data, store.url)
