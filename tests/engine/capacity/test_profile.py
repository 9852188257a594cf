"""`tideflow profile` on the tiny model: the figures a plan reads, points that cannot fit refused with the reason,
bad sweeps refused before anything runs, and the profile written whole where the flow and the CLI put it."""

from __future__ import annotations

import json
import subprocess

import pytest
from pydantic import ValidationError
from safetensors import safe_open

from engine.capacity.profile import ProfileSpec, RoleProfile, profile_role, save_profile
from engine.runtime.process import tideflow_argv

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

KV_BYTES = 2_000_000  # the tiny model's 512 bytes a token: 3,904 tokens (244 blocks of 16)


@pytest.fixture(scope="module")
def profile(tiny_model_dir, tideflow_home) -> RoleProfile:
    spec = ProfileSpec(model_dir=tiny_model_dir, kv_cache_bytes=KV_BYTES, input_lens=[16, 48], prefill_batches=[1, 3],
                       concurrency=[1, 4, 100], contexts=[16, 48], decode_tokens=6, max_num_seqs=64)
    return profile_role(spec)


def test_every_point_that_fits_is_measured_and_the_rest_say_why(profile):
    assert [(p.input_len, p.batch) for p in profile.prefill] == [(16, 1), (16, 3), (48, 1), (48, 3)]
    assert all(p.refused is None and p.ttft_s > 0 and p.tokens_per_s > 0 for p in profile.prefill)
    measured = [(d.context, d.concurrency) for d in profile.decode if d.refused is None]
    assert measured == [(16, 1), (16, 4), (48, 1), (48, 4)]
    assert all(d.itl_s > 0 and d.itl_p90_s >= d.itl_s and d.tokens_per_s > 0 for d in profile.decode if not d.refused)
    # 100 sequences of 48 + 6 tokens need 5,400 KV tokens: more than the budget holds
    (too_many,) = [d for d in profile.decode if d.context == 48 and d.concurrency == 100]
    assert too_many.refused == f"needs 5400 KV tokens, the budget holds {profile.memory.kv_tokens}"
    (over_cap,) = [d for d in profile.decode if d.context == 16 and d.concurrency == 100]
    assert over_cap.refused == "more sequences than max_num_seqs 64"


def test_the_memory_sums_match_the_checkpoint_and_the_budget(profile, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert profile.memory.kv_bytes_per_token == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        stored = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    # fp32 in memory as on disk, where the load measured plain projections faster; oneDNN's packed blocks may pad
    assert stored <= profile.memory.weights_bytes <= 1.1 * stored
    m = profile.memory
    assert m.kv_budget_bytes <= KV_BYTES and m.kv_budget_bytes == m.kv_tokens * m.kv_bytes_per_token
    assert m.kv_tokens % 16 == 0 and m.kv_tokens > KV_BYTES // m.kv_bytes_per_token - 16  # whole blocks of the budget


def test_the_profile_is_written_whole_and_reads_back(profile, tideflow_home):
    path = save_profile(profile)
    assert path.parent == tideflow_home / "profiles" and path.name.endswith("-float32-cpu.json")
    assert RoleProfile.model_validate_json(path.read_text()) == profile


@pytest.mark.parametrize("bad, field", [({"input_lens": []}, "input_lens"), ({"concurrency": [0, 4]}, "concurrency"),
                                        ({"decode_tokens": 2}, "decode_tokens"), ({"kv_cache_bytes": 0}, "kv_cache_bytes")])
def test_a_bad_sweep_is_refused_naming_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        ProfileSpec(**bad)


def test_a_sweep_past_the_models_context_is_refused_before_anything_runs(tiny_model_dir):
    with pytest.raises(ValueError, match="the model's context is 4096"):
        profile_role(ProfileSpec(model_dir=tiny_model_dir, contexts=[4096], decode_tokens=8))


def test_the_cli_writes_the_profile_and_prints_its_tables(tiny_model_dir, tmp_path):
    out = tmp_path / "p.json"
    done = subprocess.run(tideflow_argv("profile", "--model", str(tiny_model_dir), "--input-lens", "16",
                                        "--prefill-batches", "1", "--concurrency", "1", "2", "--contexts", "16",
                                        "--decode-tokens", "4", "--kv-cache-bytes", str(KV_BYTES), "--out", str(out)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = RoleProfile.model_validate_json(out.read_text())
    assert [(d.context, d.concurrency) for d in written.decode] == [(16, 1), (16, 2)]
    assert "| decode: context | sequences | ITL p50 ms |" in done.stdout and f"written: {out}" in done.stdout
    bad = subprocess.run(tideflow_argv("profile", "--model", str(tmp_path / "none")), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no checkpoint at" in bad.stderr and "Traceback" not in bad.stderr
