"""Retries where they help, none where they cannot: a transient store error vs a checksum mismatch."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.offline.default_model import TINY_CONFIG, write_default_model
from engine.weights import StoreError, publish
from flows.params import WeightsParams
from flows.publish_weights import publish_weights
from tasks import weights as weight_tasks

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_transient_store_error_is_retried_and_the_flow_completes(flow_home, tmp_path, monkeypatch):
    src = write_default_model(tmp_path / "m", TINY_CONFIG)
    real, calls = weight_tasks.publish, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise StoreError("store unreachable (injected once)")
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_tasks, "publish", flaky)
    state = publish_weights(WeightsParams(model_dir=src, name="retry", version="v1"), return_state=True)
    assert state.is_completed(), state.message
    assert len(calls) == 2
    assert state.result().endswith("/models/retry/v1/")


def test_checksum_mismatch_is_not_retried_and_fails_with_the_reason(flow_home, tmp_path, monkeypatch):
    src = write_default_model(tmp_path / "m", TINY_CONFIG)
    params = WeightsParams(model_dir=src, name="corrupt", version="v1", deep_verify=True)
    publish(src, params.url())  # stored and committed, never verified (verify results are cached by manifest)
    stored = Path(params.url().removeprefix("file://")) / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored.write_bytes(bytes(data))
    real, calls = weight_tasks.verify, []
    monkeypatch.setattr(weight_tasks, "verify", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    state = publish_weights(params, return_state=True)
    assert state.is_failed()
    assert len(calls) == 1, "a checksum mismatch is never retried"
    assert "checksum mismatch in model.safetensors" in state.message
