"""The GX gate suite on judge tables: every verdict must be pass, and nulls that mean 'no evidence' fail."""

import json

import numpy as np
import pytest

from engine.canary.gates import GateSuite, GateSuiteError, step_row
from engine.canary.judge import JudgeConfig, Samples, SequentialJudge
from engine.canary.metrics import GroupFigures
from engine.canary.plan import DEFAULT_SUITE


def samples(rng, n, factor=1.0, error_rate=0.0) -> Samples:
    ttft = 0.1 * factor * rng.lognormal(0, 0.3, n)
    return Samples(rng.random(n) >= error_rate, ttft, 0.02 * rng.lognormal(0, 0.2, n), ttft + 1.0)


def table(canary: Samples, baseline: Samples, config=JudgeConfig(min_samples=20, horizon=100)) -> list[dict]:
    return [v.model_dump() for v in SequentialJudge(config).look(canary, baseline)]


@pytest.fixture(scope="module")
def suite():
    return GateSuite(DEFAULT_SUITE)


def test_a_canary_like_stable_over_its_horizon_passes(suite):
    rng = np.random.default_rng(0)
    result = suite.validate(table(samples(rng, 100), samples(rng, 400)))
    assert result.success, result.failed
    json.dumps(result.validation)


@pytest.mark.parametrize("canary, failing", [
    (dict(factor=1.5), "verdict"),
    (dict(error_rate=0.2), "verdict"),
])
def test_a_failed_metric_fails_the_suite(suite, canary, failing):
    rng = np.random.default_rng(1)
    rows = table(samples(rng, 100, **canary), samples(rng, 400))
    result = suite.validate(rows)
    assert not result.success and any(failing in f for f in result.failed), result.failed
    assert json.loads(json.dumps(result.validation))["success"] is False


def test_too_few_samples_is_no_pass(suite):
    """Inconclusive verdicts and their null p-values both fail: GX would otherwise skip the nulls."""
    rng = np.random.default_rng(2)
    result = suite.validate(table(samples(rng, 5), samples(rng, 400)))
    assert not result.success
    failed = " ".join(result.failed)
    assert "p_value" in failed and "inconclusive" in failed


def test_the_suite_file_is_the_gate(tmp_path):
    """Loosen the suite file (accept inconclusive) and the same too-small table passes its verdict gate."""
    data = json.loads(DEFAULT_SUITE.read_text())
    data["expectations"] = [e for e in data["expectations"] if e["kwargs"].get("column") != "p_value"]
    for e in data["expectations"]:
        if e["kwargs"].get("column") == "verdict" and "value_set" in e["kwargs"]:
            e["kwargs"]["value_set"] = ["pass", "inconclusive"]
    path = tmp_path / "loose.json"
    path.write_text(json.dumps(data))
    rng = np.random.default_rng(2)
    assert GateSuite(path).validate(table(samples(rng, 5), samples(rng, 400))).success


def test_an_unknown_expectation_is_an_error_not_a_missing_gate(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"name": "t", "expectations": [
        {"type": "expect_column_values_to_be_betwen", "kwargs": {"column": "x", "max_value": 1}}]}))
    with pytest.raises(GateSuiteError, match="expect_column_values_to_be_betwen"):
        GateSuite(path)


def figures(group, requests=100, errors=0, ttft=0.05, tpot=0.01):
    return GroupFigures(group=group, requests=requests, errors=errors, error_rate=errors / requests,
                        ttft_p99_s=ttft, tpot_p99_s=tpot, throughput_tps=50.0, window_s=5.0)


def test_step_row_compares_canary_with_its_baseline():
    row = step_row(3, 100, figures("c", 10, errors=1, ttft=0.06, tpot=None), figures("s", ttft=0.05), 2)
    assert (row["step"], row["percent"], row["baseline_step"]) == (3, 100, 2)
    assert abs(row["error_rate_excess_pp"] - 10.0) < 1e-9
    assert abs(row["ttft_p99_ratio"] - 1.2) < 1e-9 and abs(row["ttft_p99_excess_ms"] - 10.0) < 1e-9
    assert row["tpot_p99_ratio"] is None and row["tpot_p99_excess_ms"] is None
