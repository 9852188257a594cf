"""URLs select stores; configs and manifests reject bad values at the boundary."""

import pytest
from pydantic import ValidationError

from engine.weights import Manifest, ManifestFile, ManifestInvalidError, StoreError, default_store_url
from engine.weights.config import MiB, FsStoreConfig, S3StoreConfig
from engine.weights.fs_store import FsStore
from engine.weights.parts import composite_sha256, sha256_b64
from engine.weights.publish import file_part_size
from engine.weights.s3_store import S3Store
from engine.weights.urls import open_store, store_config


def test_urls_select_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.delenv("TIDEFLOW_S3_ENDPOINT_URL", raising=False)
    s3 = store_config("s3://models-bucket/models/tiny/v1")
    assert isinstance(s3, S3StoreConfig)
    assert (s3.bucket, s3.prefix, s3.endpoint_url) == ("models-bucket", "models/tiny/v1/", "http://127.0.0.1:9000")
    assert s3.part_size == 64 * MiB and s3.max_concurrency == 8
    monkeypatch.setenv("TIDEFLOW_S3_ENDPOINT_URL", "http://127.0.0.1:9001")
    assert S3StoreConfig(bucket="abc").endpoint_url == "http://127.0.0.1:9001"
    assert isinstance(open_store("s3://models-bucket/x/", region="us-east-1"), S3Store)

    fs = store_config((tmp_path / "v1").as_uri() + "/")
    assert isinstance(fs, FsStoreConfig) and fs.root == tmp_path / "v1"
    assert store_config(str(tmp_path / "v2")).root == tmp_path / "v2"
    assert isinstance(open_store(str(tmp_path)), FsStore)


def test_embedded_default_lives_under_tideflow_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path))
    assert FsStoreConfig().root == tmp_path / "store"
    assert default_store_url("tiny", "v1") == (tmp_path / "store/models/tiny/v1").as_uri() + "/"


def test_an_empty_tideflow_home_means_the_default_everywhere(monkeypatch, tmp_path):
    """Not the current directory: every home() (the engine's, the kernels') reads an empty value as unset."""
    from engine.runtime.paths import home
    from tideflow_kernels.cache import home as kernels_home

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TIDEFLOW_HOME", "")
    assert home() == kernels_home() == tmp_path / ".tideflow"
    assert FsStoreConfig().root == tmp_path / ".tideflow" / "store"


@pytest.mark.parametrize("kwargs, field", [
    ({"bucket": "ab"}, "bucket"),
    ({"bucket": "Bad_Bucket"}, "bucket"),
    ({"bucket": "abc", "part_size": 4 * MiB}, "part_size"),
    ({"bucket": "abc", "max_concurrency": 0}, "max_concurrency"),
    ({"bucket": "abc", "prefix": "a/../b"}, "prefix"),
    ({"bucket": "abc", "endpoint_url": "127.0.0.1:9000"}, "endpoint_url"),
])
def test_s3_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        S3StoreConfig(**kwargs)


def test_bad_urls_are_store_errors():
    with pytest.raises(StoreError, match="no bucket"):
        store_config("s3:///x/")
    with pytest.raises(StoreError, match="part_size"):
        store_config("s3://abc/x/", part_size=1)


def _entry(**over):
    fields = dict(path="model.safetensors", size=12 * MiB, sha256="0" * 64, part_size=5 * MiB,
                  parts=[sha256_b64(b"a"), sha256_b64(b"b"), sha256_b64(b"c")])
    return ManifestFile(**{**fields, **over})


def test_manifest_validates_and_is_deterministic():
    m = Manifest(part_size=5 * MiB, files=[_entry(path="b"), _entry(path="a")])
    assert [f.path for f in m.files] == ["a", "b"]
    assert Manifest.parse(m.to_bytes(), "here") == m and Manifest.parse(m.to_bytes(), "x").digest == m.digest
    assert m.files[0].composite == composite_sha256(m.files[0].parts)
    with pytest.raises(ValidationError, match="3 parts expected"):
        _entry(parts=[sha256_b64(b"a")])
    with pytest.raises(ValidationError, match="relative"):
        _entry(path="../etc/passwd")
    with pytest.raises(ValidationError, match="duplicate"):
        Manifest(part_size=5 * MiB, files=[_entry(), _entry()])
    with pytest.raises(ManifestInvalidError, match="files"):
        Manifest.parse(b'{"part_size": 5, "files": 3}', "s3://abc/x/")


def test_huge_files_get_bigger_parts():
    assert file_part_size(100 * MiB, 5 * MiB) == 5 * MiB
    size = 100_000 * MiB
    grown = file_part_size(size, 5 * MiB)
    assert grown % MiB == 0 and -(-size // grown) <= 10_000
