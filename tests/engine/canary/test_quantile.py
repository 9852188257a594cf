"""Figures from /metrics expositions: bucket interpolation as Prometheus does it, window deltas."""

import math

from engine.canary.metrics import DirectSource, Mark, histogram_quantile, totals_from_exposition


def test_interpolates_inside_the_bucket_holding_the_rank():
    buckets = {0.1: 0, 0.25: 50, 0.5: 100, math.inf: 100}
    assert math.isclose(histogram_quantile(0.99, buckets), 0.25 + 0.25 * 49 / 50)
    assert math.isclose(histogram_quantile(0.5, buckets), 0.25)


def test_first_bucket_starts_at_zero():
    assert math.isclose(histogram_quantile(0.5, {0.2: 10, math.inf: 10}), 0.1)


def test_rank_in_the_inf_bucket_gives_the_highest_finite_bound():
    assert histogram_quantile(0.99, {0.1: 10, 1.0: 10, math.inf: 20}) == 1.0


def test_no_observations_or_no_inf_bucket_is_none():
    assert histogram_quantile(0.99, {0.1: 0, math.inf: 0}) is None
    assert histogram_quantile(0.99, {0.1: 3, 0.2: 5}) is None


ROUTER_T0 = """
tideflow_router_requests_total{group="c",status="ok",version="v2"} 10.0
tideflow_router_time_to_first_token_seconds_bucket{group="c",le="0.1",version="v2"} 10.0
tideflow_router_time_to_first_token_seconds_bucket{group="c",le="1.0",version="v2"} 10.0
tideflow_router_time_to_first_token_seconds_bucket{group="c",le="+Inf",version="v2"} 10.0
"""
ROUTER_T1 = """
tideflow_router_requests_total{group="c",status="ok",version="v2"} 16.0
tideflow_router_requests_total{group="c",status="error",version="v2"} 2.0
tideflow_router_output_tokens_total{group="c",version="v2"} 48.0
tideflow_router_time_to_first_token_seconds_bucket{group="c",le="0.1",version="v2"} 12.0
tideflow_router_time_to_first_token_seconds_bucket{group="c",le="1.0",version="v2"} 16.0
tideflow_router_time_to_first_token_seconds_bucket{group="c",le="+Inf",version="v2"} 16.0
"""
ENGINE_T1 = """
tideflow_requests_total{group="c",role="colocated",status="http_500",version="v2"} 2.0
tideflow_requests_total{group="c",role="colocated",status="length",version="v2"} 16.0
"""


def test_window_figures_diff_two_marks_and_count_engine_5xx_as_errors():
    start = Mark(at=100.0, totals=totals_from_exposition([ROUTER_T0]))
    end = Mark(at=104.0, totals=totals_from_exposition([ROUTER_T1, ENGINE_T1]))
    source = DirectSource("http://127.0.0.1:1", "unused")
    try:
        f = source.figures(start, end, ["c", "absent"])
    finally:
        source.close()
    c = f["c"]
    assert (c.version, c.requests, c.errors, c.window_s) == ("v2", 10.0, 4.0, 4.0)
    assert math.isclose(c.error_rate, 0.4) and math.isclose(c.throughput_tps, 12.0)
    assert math.isclose(c.ttft_p99_s, 0.1 + 0.9 * (0.99 * 6 - 2) / 4)  # rank 5.94 of 6, 2 below 0.1 s
    assert f["absent"].requests == 0 and f["absent"].error_rate is None and f["absent"].ttft_p99_s is None
