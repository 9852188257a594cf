"""Publish -> verify -> pull on both stores; identical re-publish is a no-op; conflicts are refused."""

import hashlib

import pytest

from engine.weights import (
    ManifestMissingError,
    VersionConflictError,
    publish,
    pull,
    require_verified,
    verify,
)
from engine.weights.manifest import read_manifest

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_publish_verify_pull_roundtrip(backend, checkpoint, total_parts, tmp_path):
    events = []
    report = publish(checkpoint, backend.store(), progress=events.append)
    assert report.manifest_written and report.parts_uploaded == total_parts
    manifest = read_manifest(backend.store())
    assert [f.path for f in manifest.files] == sorted(p.name for p in checkpoint.iterdir())
    for entry in manifest.files:
        assert entry.size == (checkpoint / entry.path).stat().st_size
        assert entry.sha256 == _sha(checkpoint / entry.path)
    assert manifest.config_sha256 == _sha(checkpoint / "config.json")
    assert manifest.part_size == backend.part_size
    assert events[-1].bytes_done == events[-1].bytes_total == sum(f.size for f in manifest.files)
    assert events[-1].parts_sent == total_parts

    assert verify(backend.url).files_checked == len(manifest.files)
    deep = verify(backend.url, deep=True, max_concurrency=backend.concurrency)
    assert deep.bytes_read == sum(f.size for f in manifest.files)

    cache = tmp_path / "cache"
    pulled = pull(backend.url, cache, max_concurrency=backend.concurrency)
    assert not pulled.noop and pulled.files_fetched == len(manifest.files)
    for entry in manifest.files:
        assert (cache / entry.path).read_bytes() == (checkpoint / entry.path).read_bytes()
    assert require_verified(cache, deep=True) == manifest
    again = pull(backend.url, cache)
    assert again.noop and again.bytes_fetched == 0


def test_republish_identical_uploads_nothing(backend, checkpoint):
    first = publish(checkpoint, backend.store())
    store = backend.store()
    events = []
    second = publish(checkpoint, store, progress=events.append)
    assert second.parts_uploaded == 0 and store.counters.parts_uploaded == 0
    assert store.counters.bytes_uploaded == 0
    assert second.files_unchanged == len(first.manifest.files)
    assert not second.manifest_written and second.manifest == first.manifest
    assert events and all(e.parts_sent == 0 for e in events)


def test_changed_content_is_refused_unless_forced(backend, own_checkpoint, tmp_path):
    original = publish(own_checkpoint, backend.store()).manifest
    shard = own_checkpoint / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[5_500_000] ^= 1
    shard.write_bytes(bytes(data))

    store = backend.store()
    with pytest.raises(VersionConflictError, match="model-00002-of-00002.safetensors.*--force"):
        publish(own_checkpoint, store)
    assert store.counters.parts_uploaded == 0
    assert read_manifest(backend.store()) == original

    forced = publish(own_checkpoint, backend.store(), force=True)
    assert forced.manifest_written and forced.parts_uploaded == 2  # only the changed shard
    assert forced.manifest.file(shard.name).sha256 == _sha(shard)
    verify(backend.url, deep=True)
    cache = tmp_path / "cache"
    pull(backend.url, cache)
    assert (cache / shard.name).read_bytes() == bytes(data)


def test_extra_file_is_a_conflict(backend, own_checkpoint):
    publish(own_checkpoint, backend.store())
    (own_checkpoint / "extra.bin").write_bytes(b"new")
    with pytest.raises(VersionConflictError, match="extra.bin"):
        publish(own_checkpoint, backend.store())


def test_unpublished_version_is_a_clear_error(backend, tmp_path):
    with pytest.raises(ManifestMissingError, match="not published"):
        verify(backend.url)
    with pytest.raises(ManifestMissingError, match="tideflow weights publish"):
        pull(backend.url, tmp_path / "cache")
