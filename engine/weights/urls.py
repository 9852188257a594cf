"""URL -> store: `s3://bucket/prefix/` selects S3, `file:///path/` or a plain path a directory."""

from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from engine.runtime.paths import home
from engine.weights.config import FsStoreConfig, S3StoreConfig
from engine.weights.errors import StoreError
from engine.weights.fs_store import FsStore
from engine.weights.store import ObjectStore


def default_store_url(name: str, version: str) -> str:
    """Where a version lives in the embedded filesystem store: $TIDEFLOW_HOME/store/models/<name>/<version>/."""
    return (home() / "store" / "models" / name / version).absolute().as_uri() + "/"


def store_config(url: str, **transfer: int | float | str | None) -> S3StoreConfig | FsStoreConfig:
    """The pydantic config a URL denotes; `transfer` overrides part_size / max_concurrency, and for S3 region /
    timeout_s / max_attempts."""
    overrides = {k: v for k, v in transfer.items() if v is not None}
    parsed = urlparse(url)
    try:
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise StoreError(f"{url!r} names no bucket; use s3://bucket/prefix/")
            return S3StoreConfig(bucket=parsed.netloc, prefix=parsed.path, **overrides)
        for s3_only in ("region", "timeout_s", "max_attempts"):
            overrides.pop(s3_only, None)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise StoreError(f"{url!r}: file URLs must be local (file:///path/)")
            return FsStoreConfig(root=Path(unquote(parsed.path)), **overrides)
        if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or a Windows drive letter)
            return FsStoreConfig(root=Path(url), **overrides)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise StoreError(f"bad store config for {url}: {field}: {first['msg']}") from None
    raise StoreError(f"unsupported URL scheme {parsed.scheme!r} in {url!r}; use s3://, file:// or a path")


def open_store(
    url: str, *, part_size: int | None = None, max_concurrency: int | None = None, region: str | None = None,
    timeout_s: float | None = None, max_attempts: int | None = None,
) -> ObjectStore:
    """The store for a version URL."""
    config = store_config(url, part_size=part_size, max_concurrency=max_concurrency, region=region,
                          timeout_s=timeout_s, max_attempts=max_attempts)
    if isinstance(config, S3StoreConfig):
        from engine.weights.s3_store import S3Store  # boto3 loads only for s3:// (a command that opens none starts faster)

        return S3Store(config)
    return FsStore(config)
