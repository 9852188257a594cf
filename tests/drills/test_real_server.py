"""A short step-load drill against the real engine (`tideflow serve` on the tiny model)."""

from __future__ import annotations

import os

import pytest

from drills.expectations import DEFAULT_SUITE
from drills.load import run_load_drill
from drills.spec import LoadDrillSpec
from engine.runtime.process import Child, free_port, tideflow_argv, wait_http_ok

pytestmark = [pytest.mark.timeout(180), pytest.mark.fleet]
KEY = "drill-key"


@pytest.fixture(scope="module")
def engine_server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    argv = tideflow_argv("serve", "--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
                         "--kv-cache-bytes", str(16 << 20), "--max-wait-ms", "1")
    child = Child("serve-drill", argv, tmp_path_factory.mktemp("logs") / "serve.log", {"TIDEFLOW_API_KEYS": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http_ok(url + "/ready", 90, child, KEY):
            raise RuntimeError(f"serve did not become ready: {child.log_tail()}")
        yield url
    finally:
        child.stop()


def test_step_drill_of_the_engine_finds_a_watermark_and_reports(engine_server, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DRILL_API_KEY", KEY)
    spec = LoadDrillSpec(
        url=engine_server, model="tiny", api_key_env="DRILL_API_KEY", steps=[2, 8], hold_s=1.5,
        prompt_len="fixed:24", output_len="fixed:16", tokenizer_dir=tiny_model_dir,
        slo_ttft_ms=2000, slo_tpot_ms=500, out_dir=tmp_path / "drill", progress_bar=False, expectations_suite=DEFAULT_SUITE,
    )
    report = run_load_drill(spec)
    assert report.sent == report.ok + report.error and report.error == 0, [s.error_reasons for s in report.steps]
    # The server's own usage counts: prompts were calibrated to exactly 24 tokens, and ignore_eos gave all 16.
    assert {r.prompt_tokens for r in report.requests} == {24}
    assert {r.output_tokens for r in report.requests} == {16}
    assert report.capacity_rps in (2, 8)
    assert all(s.ttft_p50 > 0 and s.tpot_p50 > 0 and s.output_tok_s > 0 for s in report.steps)
    assert report.expectations.success, report.expectations
    assert all(os.path.getsize(p) > 0 for p in report.files.values())


def test_wrong_api_key_is_counted_as_http_401(engine_server, monkeypatch):
    monkeypatch.setenv("DRILL_API_KEY", "not-the-key")
    spec = LoadDrillSpec(url=engine_server, model="tiny", api_key_env="DRILL_API_KEY", rate=5, duration_s=0.4,
                         arrival="constant", progress_bar=False, expectations_suite=None)
    report = run_load_drill(spec)
    assert report.sent == report.error == 2 and all(r.error.startswith("http 401") for r in report.requests)
