"""Flipped bytes in the store or the cache are caught; the engine gate refuses unverified weights."""

import os

import pytest

from engine.weights import (
    ChecksumMismatchError,
    ManifestInvalidError,
    ObjectMissingError,
    StoreError,
    UnverifiedWeightsError,
    WeightsError,
    publish,
    pull,
    require_verified,
    verify,
)

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

SHARD = "model-00001-of-00002.safetensors"


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def test_flipped_stored_byte_caught_by_deep_verify_and_pull(backend, checkpoint, tmp_path):
    publish(checkpoint, backend.store())
    backend.flip_byte(SHARD, 7_000_000)  # inside part 2
    with pytest.raises(ChecksumMismatchError, match=f"{SHARD}.*part 2.*republish"):
        verify(backend.url, deep=True)
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumMismatchError, match=SHARD):
        pull(backend.url, cache)
    assert not (cache / SHARD).exists()
    assert not list(cache.glob("*.tideflow-partial"))
    with pytest.raises(UnverifiedWeightsError):
        require_verified(cache)


def test_checksum_mismatch_is_not_a_store_error():
    """The Prefect layer retries StoreError and must be able to tell a mismatch apart."""
    assert issubclass(ChecksumMismatchError, WeightsError)
    assert not issubclass(ChecksumMismatchError, StoreError)


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_s3_object_replaced_outside_publish_fails_cheap_verify(backend, checkpoint):
    publish(checkpoint, backend.store())
    verify(backend.url)
    backend.flip_byte(SHARD, 10)  # a plain PUT: the object loses its composite SHA-256
    with pytest.raises(ChecksumMismatchError, match=f"{SHARD}.*no SHA-256.*--deep"):
        verify(backend.url)


def test_corrupted_and_partial_cache_files_are_refetched(backend, checkpoint, tmp_path):
    publish(checkpoint, backend.store())
    cache = tmp_path / "cache"
    pull(backend.url, cache)

    _flip(cache / SHARD, 100)
    (cache / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes()[:1000])
    with pytest.raises(UnverifiedWeightsError, match="changed since it was verified.*tideflow weights pull"):
        require_verified(cache)

    report = pull(backend.url, cache)
    assert not report.noop and report.files_fetched == 2 and report.files_kept == 2
    for name in (SHARD, "tokenizer.json"):
        assert (cache / name).read_bytes() == (checkpoint / name).read_bytes()
    require_verified(cache, deep=True)


@pytest.mark.parametrize("backend", ["fs"], indirect=True)
def test_deep_gate_catches_what_the_cheap_gate_cannot(backend, checkpoint, tmp_path):
    publish(checkpoint, backend.store())
    cache = tmp_path / "cache"
    pull(backend.url, cache)
    path = cache / SHARD
    st = path.stat()
    _flip(path, 0)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only a re-hash sees it
    require_verified(cache)
    with pytest.raises(UnverifiedWeightsError, match=f"{SHARD} does not match its SHA-256"):
        require_verified(cache, deep=True)


def test_gate_refuses_a_plain_directory(checkpoint):
    with pytest.raises(UnverifiedWeightsError, match="no manifest.json"):
        require_verified(checkpoint)


def test_missing_object_and_invalid_manifest_are_clear_errors(backend, checkpoint, tmp_path):
    store = backend.store()
    publish(checkpoint, store)
    store.delete("tokenizer.json")
    with pytest.raises(ObjectMissingError, match="tokenizer.json.*republish"):
        verify(backend.url)
    with pytest.raises(ObjectMissingError, match="tokenizer.json"):
        pull(backend.url, tmp_path / "cache")
    store.write_bytes("manifest.json", b'{"format": 1, "files": "nope"}')
    with pytest.raises(ManifestInvalidError, match="not a valid tideflow manifest"):
        pull(backend.url, tmp_path / "cache")
