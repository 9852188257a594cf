"""A published version's URL becomes a verified node-local checkpoint directory (what `serve --model URL` does)."""

from __future__ import annotations

from engine.offline.default_model import TINY_CONFIG, write_default_model
from engine.model.loader import load_model
from engine.weights import cache_dir_for, local_model_dir, publish, require_verified


def test_url_is_pulled_into_a_verified_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDEFLOW_HOME", str(tmp_path / "home"))
    src = write_default_model(tmp_path / "m", TINY_CONFIG)
    url = (tmp_path / "store" / "models" / "tiny" / "v1").as_uri() + "/"
    publish(src, url)
    local = local_model_dir(url)
    assert local == cache_dir_for(url)
    assert require_verified(local).files
    assert load_model(local).config.hidden_size == TINY_CONFIG.hidden_size
    assert local_model_dir(str(src)) == src
