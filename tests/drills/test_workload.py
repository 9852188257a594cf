"""Length laws, prompts, traces and the arrival schedule: reproducible from the seed, validated at the boundary."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from drills.spec import LoadDrillSpec
from drills.lengths import LengthDistribution
from drills.workload import PromptSynthesizer, build_schedule, load_trace, step_arrivals
from engine.model.tokenizer import Tokenizer


@pytest.mark.parametrize("text, kind, lo, hi", [
    ("32", "fixed", 32, 32), ("fixed:8", "fixed", 8, 8), ("uniform:16:64", "uniform", 16, 64),
    ("normal:100:30:50:150", "normal", 50, 150), ("lognormal:64:0.5:1:400", "lognormal", 1, 400),
    ("normal:10:20", "normal", 1, None),
])
def test_length_specs_parse_and_samples_stay_in_range(text, kind, lo, hi):
    dist = LengthDistribution.parse(text)
    assert dist.kind == kind
    x = dist.sample(np.random.default_rng(0), 2000)
    assert x.dtype.kind == "i" and x.min() >= lo and (hi is None or x.max() <= hi)
    assert LengthDistribution.parse(str(dist)) == dist


def test_uniform_covers_its_range_and_normal_centres_on_mu():
    rng = np.random.default_rng(1)
    u = LengthDistribution.parse("uniform:4:6").sample(rng, 600)
    assert set(u.tolist()) == {4, 5, 6}
    n = LengthDistribution.parse("normal:200:10").sample(rng, 4000)
    assert abs(n.mean() - 200) < 2


@pytest.mark.parametrize("bad", ["uniform:9:3", "gauss:1:2", "uniform:4", "fixed:0", "normal:5:1:9", "fixed:x", "normal:9:1:20:10"])
def test_bad_length_specs_fail_with_the_spec_in_the_message(bad):
    with pytest.raises(ValueError, match="bad length spec"):
        LengthDistribution.parse(bad)


def test_constant_arrivals_are_evenly_spaced_and_poisson_matches_the_rate():
    assert np.allclose(step_arrivals(np.random.default_rng(0), 4.0, 2.0, "constant"), np.arange(8) / 4)
    times = step_arrivals(np.random.default_rng(0), 200.0, 10.0, "poisson")
    assert abs(len(times) - 2000) < 4 * np.sqrt(2000)
    assert np.all(np.diff(times) > 0) and times.max() < 10.0


def test_schedule_is_reproducible_from_the_seed_and_steps_follow_the_hold():
    spec = LoadDrillSpec(url="http://127.0.0.1:1", model="m", steps=[2, 8], hold_s=3, seed=7)
    a, rates = build_schedule(spec)
    b, _ = build_schedule(spec)
    c, _ = build_schedule(spec.model_copy(update={"seed": 8}))
    assert a == b and a != c and rates == [2, 8]
    assert all(p.step * 3 <= p.arrival_s < (p.step + 1) * 3 for p in a)
    assert [p.index for p in a] == list(range(len(a)))
    assert all(16 <= p.prompt_tokens <= 64 and len(p.prompt.split()) == p.prompt_tokens for p in a)
    assert len({p.prompt for p in a}) == len(a)  # distinct prompts: no accidental prefix-cache hits


def test_tokenizer_calibration_gives_exact_prompt_lengths(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    synth = PromptSynthesizer(np.random.default_rng(0), tiny_model_dir)
    for n in (1, 7, 33, 128):
        text, count = synth.make(n)
        assert count == n and len(tok.encode(text)) == n


def test_trace_replay_uses_its_arrivals_and_trace_without_them_needs_a_rate(tmp_path):
    timed = tmp_path / "timed.jsonl"
    timed.write_text("\n".join(json.dumps({"prompt": f"p {i}", "max_tokens": i + 1, "arrival_s": 0.5 * (3 - i)})
                               for i in range(4)) + "\n\n")
    plan, rates = build_schedule(LoadDrillSpec(url="http://x", model="m", trace=timed))
    assert [p.arrival_s for p in plan] == [0.0, 0.5, 1.0, 1.5] and [p.max_tokens for p in plan] == [4, 3, 2, 1]
    assert rates == [4 / 1.5]
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text(json.dumps({"prompt": "hello", "max_tokens": 3}) + "\n")
    with pytest.raises(ValueError, match="arrival_s"):
        build_schedule(LoadDrillSpec(url="http://x", model="m", trace=untimed))
    plan, _ = build_schedule(LoadDrillSpec(url="http://x", model="m", trace=untimed, rate=5, duration_s=1, arrival="constant"))
    assert len(plan) == 5 and all(p.prompt == "hello" and p.max_tokens == 3 for p in plan)


def test_bad_trace_lines_name_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "a", "max_tokens": 1}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        load_trace(path)


@pytest.mark.parametrize("fields, message", [
    ({"rate": 1}, "rate and duration_s go together"),
    ({"rate": 1, "duration_s": 1, "steps": [1], "hold_s": 1}, "not both"),
    ({}, "give rate"),
    ({"steps": [1, 0], "hold_s": 1}, "> 0"),
    ({"rate": 1, "duration_s": 1, "prompt_len": "uniform:5:1"}, "bad length spec"),
])
def test_spec_rejects_inconsistent_modes(fields, message):
    with pytest.raises(ValidationError, match=message):
        LoadDrillSpec(url="http://x", model="m", **fields)


def test_a_drill_in_a_flow_run_names_the_run_in_every_requests_baggage():
    from drills.load import _client
    from engine.telemetry.tracing import FLOW_RUN_BAGGAGE

    run = "0c6f1e52-9a0b-4f37-8d2e-5b7b1b2d4e11"
    spec = LoadDrillSpec(url="http://127.0.0.1:1", model="m", rate=1, duration_s=1, flow_run_id=run)
    assert _client(spec).default_headers["baggage"] == f"{FLOW_RUN_BAGGAGE}={run}"
    assert "baggage" not in _client(spec.model_copy(update={"flow_run_id": None})).default_headers
    with pytest.raises(ValidationError):
        LoadDrillSpec(url="http://127.0.0.1:1", model="m", rate=1, duration_s=1, flow_run_id="x,evil=1")
