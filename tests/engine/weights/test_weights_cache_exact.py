"""A verified cache is exactly its manifest: unlisted files are refused (and removed by a pull), no
symbolic link is followed inside a store or a cache, and the cache's own names cannot be published."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil

import pytest
from pydantic import ValidationError

from engine.weights import publish, pull, require_verified
from engine.weights.errors import UnverifiedWeightsError, WeightsError
from engine.weights.manifest import Manifest


@pytest.fixture
def published(own_checkpoint, tmp_path):
    url = (tmp_path / "store" / "v1").as_uri() + "/"
    publish(own_checkpoint, url)
    return url


def test_a_file_dropped_into_a_verified_cache_is_refused_then_removed_by_pull(published, tmp_path):
    cache = tmp_path / "cache"
    pull(published, cache)
    require_verified(cache)
    (cache / "zz.safetensors").write_bytes(b"not in the manifest")
    with pytest.raises(UnverifiedWeightsError, match="zz.safetensors is not in the manifest"):
        require_verified(cache)
    report = pull(published, cache)
    assert not (cache / "zz.safetensors").exists() and report.files_fetched == 0
    require_verified(cache)


def test_pull_of_a_new_version_removes_the_old_versions_files(own_checkpoint, tmp_path):
    v1 = (tmp_path / "store" / "v1").as_uri() + "/"
    publish(own_checkpoint, v1)
    (own_checkpoint / "model-00002-of-00002.safetensors").unlink()
    (own_checkpoint / "extra-v2.bin").write_bytes(os.urandom(1000))
    v2 = (tmp_path / "store" / "v2").as_uri() + "/"
    publish(own_checkpoint, v2)
    cache = tmp_path / "cache"
    pull(v1, cache)
    pull(v2, cache)
    assert not (cache / "model-00002-of-00002.safetensors").exists()
    assert sorted(f.path for f in require_verified(cache).files) == sorted(p.name for p in own_checkpoint.iterdir())


def test_a_symlinked_directory_in_the_cache_is_not_written_through(published, tmp_path, own_checkpoint):
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (own_checkpoint / "sub").mkdir()
    (own_checkpoint / "sub" / "w.bin").write_bytes(os.urandom(100))
    url = (tmp_path / "store" / "nested").as_uri() + "/"
    publish(own_checkpoint, url)
    os.symlink(outside, cache / "sub")
    pull(url, cache)
    assert list(outside.iterdir()) == []  # nothing written outside the cache
    assert (cache / "sub").is_dir() and not (cache / "sub").is_symlink()
    require_verified(cache)


def test_a_symlink_in_the_cache_is_refused(published, tmp_path):
    cache = tmp_path / "cache"
    pull(published, cache)
    target = cache / "config.json"
    shutil.move(target, tmp_path / "moved.json")
    os.symlink(tmp_path / "moved.json", target)
    with pytest.raises(UnverifiedWeightsError, match="config.json is not in the manifest"):
        require_verified(cache)


def test_a_symlink_inside_a_filesystem_store_is_never_copied(own_checkpoint, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the store")
    root = tmp_path / "store" / "v1"
    url = root.as_uri() + "/"
    publish(own_checkpoint, url)
    (root / "config.json").unlink()
    os.symlink(secret, root / "config.json")
    with pytest.raises(WeightsError, match="symbolic link"):
        pull(url, tmp_path / "cache")
    assert not (tmp_path / "cache" / "config.json").exists()


@pytest.mark.parametrize("name", [".tideflow-verified.json", "sub/.tideflow.lock", "manifest.json",
                                  "model.safetensors.tideflow-partial"])
def test_the_caches_own_names_cannot_be_listed(name):
    part = base64.b64encode(hashlib.sha256(b"x").digest()).decode()
    entry = {"path": name, "size": 1, "sha256": hashlib.sha256(b"x").hexdigest(), "part_size": 1, "parts": [part]}
    ok = {**entry, "path": "model.safetensors"}
    Manifest.model_validate({"part_size": 1, "files": [ok]})  # the same entry under an ordinary name passes
    with pytest.raises(ValidationError, match="reserved"):
        Manifest.model_validate({"part_size": 1, "files": [entry]})


def test_serve_refuses_an_unverified_cache_with_the_weights_exit_status(published, tmp_path, capsys):
    """The member's exit status says why it ended, so the controller counts it as a weights failure (and the
    TideflowWeightsUnverified alert fires) instead of an anonymous crash."""
    from engine.runtime.errors import EXIT_WEIGHTS
    from flows.cli import main

    cache = tmp_path / "cache"
    pull(published, cache)
    (cache / "zz.safetensors").write_bytes(b"not in the manifest")
    assert main(["serve", "--model", str(cache)]) == EXIT_WEIGHTS
    assert "zz.safetensors is not in the manifest" in capsys.readouterr().err
