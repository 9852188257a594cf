"""Store configs (pydantic): where a version lives and how it is transferred."""

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.runtime.paths import home

MiB = 1 << 20
S3_MIN_PART = 5 * MiB  # S3 rejects smaller parts, except the last one of an upload
S3_MAX_PART = 5 * 1024 * MiB
DEFAULT_PART_SIZE = 64 * MiB
DEFAULT_CONCURRENCY = 8


def _env_endpoint() -> str | None:
    return os.environ.get("TIDEFLOW_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None


def _normalize_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"prefix {prefix!r} has an empty, '.' or '..' segment")
    return prefix + "/" if prefix else ""


class TransferConfig(BaseModel):
    """Part size and parallelism shared by both stores."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    part_size: int = Field(
        DEFAULT_PART_SIZE, ge=S3_MIN_PART, le=S3_MAX_PART,
        description="bytes per multipart part (and per ranged GET); 5 MiB..5 GiB",
    )
    max_concurrency: int = Field(
        DEFAULT_CONCURRENCY, ge=1, le=64, description="parts in flight at once (threads)"
    )


class S3StoreConfig(TransferConfig):
    """An S3-compatible bucket (AWS S3, MinIO, Ceph RGW); credentials come from the AWS chain."""

    bucket: str = Field(
        ..., min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.\-]*[a-z0-9]$",
        description="bucket name",
    )
    prefix: str = Field("", description="key prefix of the version, e.g. models/<name>/<version>/")
    endpoint_url: str | None = Field(
        default_factory=_env_endpoint,
        description="S3 endpoint (MinIO, Ceph, moto); default $TIDEFLOW_S3_ENDPOINT_URL or $AWS_ENDPOINT_URL",
    )
    region: str | None = Field(None, description="region name; None lets the AWS chain decide")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="connect and read timeout of one request")
    max_attempts: int = Field(5, ge=1, le=20, description="tries of one request (botocore's standard retries)")

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _normalize_prefix(v)

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"endpoint_url {v!r} must start with http:// or https://")
        return v

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


class FsStoreConfig(TransferConfig):
    """A directory used as an object store: the embedded default under $TIDEFLOW_HOME/store."""

    root: Path = Field(
        default_factory=lambda: home() / "store", description="store root directory"
    )
    prefix: str = Field("", description="key prefix of the version below root")

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return _normalize_prefix(v)

    @field_validator("root")
    @classmethod
    def _root(cls, v: Path) -> Path:
        return v.expanduser().absolute()

    @property
    def url(self) -> str:
        return (self.root / self.prefix).as_uri() + "/"
