"""The GX gate suite on step tables: thresholds from the suite file, results JSON-serialisable."""

import json

import pytest

from engine.canary.gates import GateSuite, GateSuiteError, step_row
from engine.canary.metrics import GroupFigures
from engine.canary.plan import DEFAULT_SUITE


def figures(group, requests=100, errors=0, ttft=0.05, tpot=0.01):
    return GroupFigures(group=group, requests=requests, errors=errors, error_rate=errors / requests,
                        ttft_p99_s=ttft, tpot_p99_s=tpot, throughput_tps=50.0, window_s=5.0)


@pytest.fixture(scope="module")
def suite():
    return GateSuite(DEFAULT_SUITE)


def test_a_canary_like_stable_passes(suite):
    result = suite.validate([step_row(0, 5, figures("c", 10), figures("s"), 0)])
    assert result.success and result.failed == []
    json.dumps(result.validation)


@pytest.mark.parametrize("canary, column", [
    (figures("c", 10, errors=1), "error_rate_excess_pp"),
    (figures("c", 10, ttft=0.07), "ttft_p99_ratio"),
    (figures("c", 10, tpot=0.013), "tpot_p99_ratio"),
    (figures("c", 10, errors=10), "canary_requests"),
])
def test_each_gate_fails_on_its_own_figure(suite, canary, column):
    result = suite.validate([step_row(0, 5, figures("s"), figures("s"), 0), step_row(1, 25, canary, figures("s"), 1)])
    assert not result.success
    assert any(column in f for f in result.failed), result.failed
    assert json.loads(json.dumps(result.validation))["success"] is False


def test_thresholds_come_from_the_suite_file(tmp_path):
    data = json.loads(DEFAULT_SUITE.read_text())
    for e in data["expectations"]:
        if e["kwargs"].get("column") == "ttft_p99_ratio":
            e["kwargs"]["max_value"] = 2.0
    path = tmp_path / "loose.json"
    path.write_text(json.dumps(data))
    row = step_row(0, 5, figures("c", 10, ttft=0.07), figures("s"), 0)
    assert GateSuite(path).validate([row]).success


def test_an_unknown_expectation_is_an_error_not_a_missing_gate(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"name": "t", "expectations": [
        {"type": "expect_column_values_to_be_betwen", "kwargs": {"column": "x", "max_value": 1}}]}))
    with pytest.raises(GateSuiteError, match="expect_column_values_to_be_betwen"):
        GateSuite(path)


def test_step_row_compares_canary_with_its_baseline():
    row = step_row(3, 100, figures("c", 10, errors=1, ttft=0.06, tpot=None), figures("s", ttft=0.05), 2)
    assert (row["step"], row["percent"], row["baseline_step"]) == (3, 100, 2)
    assert abs(row["error_rate_excess_pp"] - 10.0) < 1e-9
    assert abs(row["ttft_p99_ratio"] - 1.2) < 1e-9 and abs(row["ttft_p99_excess_ms"] - 10.0) < 1e-9
    assert row["tpot_p99_ratio"] is None and row["tpot_p99_excess_ms"] is None
