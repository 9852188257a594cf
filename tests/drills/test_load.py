"""The load drill against real HTTP servers whose latencies are known: what it measures, counts and concludes."""

from __future__ import annotations

import json
import socket

import pandas as pd
import pytest

from drills.expectations import DEFAULT_SUITE, validate_steps
from drills.load import run_load_drill
from harness.reference_server import ReferenceLatency, serve_reference
from drills.results import LoadDrillReport
from drills.spec import LoadDrillSpec

pytestmark = [pytest.mark.timeout(120), pytest.mark.fleet]
MODEL = "reference"
# Wide open: no queueing, so measured latencies should sit just above the configured ones.
KNOWN = ReferenceLatency(ttft_s=0.1, tpot_s=0.02, slots=256)
# Two slots serving 8-token requests in ~0.09 s: about 22 req/s of capacity, so 60 req/s overloads it.
SATURABLE = ReferenceLatency(ttft_s=0.02, tpot_s=0.01, slots=2)


@pytest.fixture(scope="module")
def known_server():
    with serve_reference(MODEL, KNOWN) as url:
        yield url


@pytest.fixture(scope="module")
def saturable_server():
    with serve_reference(MODEL, SATURABLE) as url:
        yield url


def _spec(url: str, **fields) -> LoadDrillSpec:
    base = {"url": url, "model": MODEL, "progress_bar": False, "expectations_suite": None}
    return LoadDrillSpec(**(base | fields))


def _accounted(report: LoadDrillReport) -> None:
    assert report.sent == report.ok + report.error == len(report.requests)
    assert all(s.sent == s.ok + s.error for s in report.steps)
    assert all((r.error is None) == r.ok for r in report.requests)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_measures_the_known_ttft_tpot_and_itl(known_server, endpoint):
    report = run_load_drill(_spec(known_server, endpoint=endpoint, rate=10, duration_s=1.5, arrival="constant",
                                  output_len="fixed:10"))
    _accounted(report)
    (step,) = report.steps
    assert step.sent == 15 and step.ok == 15 and step.output_tokens == 150
    ttft, tpot = KNOWN.ttft_s * 1000, KNOWN.tpot_s * 1000
    # Lower bounds are hard (the server sleeps that long); upper bounds leave room for a busy shared machine
    # (two test suites at once on two cores) yet stay below what a mix-up would give (TTFT taken as
    # end to end is ~280 ms).
    assert 0.95 * ttft <= step.ttft_p50 <= 2 * ttft + 50
    assert 0.95 * tpot <= step.tpot_p50 <= 2 * tpot + 10
    assert 0.9 * tpot <= step.itl_p50 <= 2 * tpot + 10
    assert all(r.output_tokens == 10 and len(r.itl_gaps_ms) == 9 for r in report.requests)
    # End to end is first chunk + every gap + the closing events: never less, and (median) not much more.
    # Per request, not medians of different requests, which a busy machine makes disagree.
    tails = [r.e2e_ms - r.ttft_ms - sum(r.itl_gaps_ms) for r in report.requests]
    assert min(tails) >= -1e-6 and sorted(tails)[len(tails) // 2] < 0.2 * step.e2e_p50, tails


def test_every_failure_is_counted_with_its_reason(known_server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    prompts = ["fine words here", "please FAIL now", "BREAK the stream", "more fine words"]
    trace.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4, "arrival_s": 0.05 * i}) + "\n"
                             for i, p in enumerate(prompts * 3)))
    report = run_load_drill(_spec(known_server, trace=trace))
    _accounted(report)
    assert (report.sent, report.ok, report.error) == (12, 6, 6)
    reasons = report.steps[0].error_reasons
    assert reasons.get("http 500: injected failure (prompt contains FAIL)") == 3, reasons
    assert sum(n for r, n in reasons.items() if "FAIL" not in r) == 3
    failed = {r.index: r for r in report.requests if not r.ok}
    assert all(("FAIL" in prompts[i % 4]) or ("BREAK" in prompts[i % 4]) for i in failed)


def test_unknown_model_timeouts_and_in_flight_cap_are_errors_not_losses(known_server):
    wrong = run_load_drill(_spec(known_server, model="nope", rate=10, duration_s=0.3, arrival="constant"))
    _accounted(wrong)
    assert wrong.ok == 0 and all(r.error.startswith("http 404") for r in wrong.requests)

    slow = run_load_drill(_spec(known_server, rate=10, duration_s=0.3, arrival="constant", request_timeout_s=0.03))
    _accounted(slow)
    assert slow.ok == 0 and all(r.error.startswith("timeout") for r in slow.requests)

    capped = run_load_drill(_spec(known_server, rate=40, duration_s=0.5, arrival="constant", max_in_flight=3,
                                  output_len="fixed:4"))
    _accounted(capped)
    dropped = [r for r in capped.requests if r.error == "dropped: 3 requests in flight"]
    assert capped.sent == 20 and 0 < len(dropped) and capped.ok + len(dropped) == capped.sent


def test_unreachable_server_gives_connection_errors():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    report = run_load_drill(_spec(f"http://127.0.0.1:{port}", rate=5, duration_s=0.4, arrival="constant"))
    _accounted(report)
    assert report.ok == 0 and all(r.error.startswith("connection") for r in report.requests)
    assert report.capacity_rps is None and not report.steps[0].slo_held


def test_step_load_finds_the_watermark_writes_reports_and_passes_the_suite(saturable_server, tmp_path):
    seen = []
    spec = _spec(saturable_server, steps=[4, 8, 60], hold_s=1.5, output_len="fixed:8", prompt_len="fixed:16",
                 slo_ttft_ms=250, slo_tpot_ms=50, out_dir=tmp_path / "out", expectations_suite=DEFAULT_SUITE)
    report = run_load_drill(spec, progress=seen.append)
    _accounted(report)
    assert [s.slo_held for s in report.steps] == [True, True, False]
    assert report.capacity_rps == 8 and report.capacity_step == 1
    top = report.steps[2]
    assert top.ttft_p90 > 250 and top.req_s < 40 and top.goodput_req_s < top.req_s
    assert len(seen) == report.sent and seen[-1].done == seen[-1].total == report.sent

    assert report.expectations is not None and report.expectations.success, report.expectations
    requests = pd.read_csv(report.files["requests_csv"])
    steps = pd.read_csv(report.files["steps_csv"])
    assert len(requests) == report.sent and len(steps) == 3 and list(steps["sent"]) == [s.sent for s in report.steps]
    summary = json.loads(open(report.files["summary_json"]).read())
    assert summary["capacity_rps"] == 8 and summary["files"] == report.files and "requests" not in summary
    for key in ("latency_over_time_png", "latency_per_step_png", "throughput_png"):
        with open(report.files[key], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    lossy = report.model_copy(deep=True)
    lossy.steps[1].sent += 1  # a request that never came back
    outcome = validate_steps(lossy, DEFAULT_SUITE)
    assert not outcome.success and any("expect_column_pair_values_to_be_equal" in f for f in outcome.failed)


def test_a_request_that_vanishes_without_a_record_fails_the_accounting(known_server, monkeypatch):
    """`sent` is the generator's own count, taken before each request leaves: a request whose result never
    comes back (here its task dies without producing a record) leaves sent != ok + error."""
    from drills import load

    real_send = load._send

    async def lossy_send(client, spec, req, t0):
        if req.index == 3:
            raise RuntimeError("this request's record is lost")
        return await real_send(client, spec, req, t0)

    monkeypatch.setattr(load, "_send", lossy_send)
    report = run_load_drill(_spec(known_server, rate=20, duration_s=0.5, output_len="fixed:2"))
    assert report.sent >= 5 and report.lost == 1 and not report.accounted
    assert report.ok + report.error == report.sent - 1


def test_every_issued_request_is_accounted_for(known_server):
    report = run_load_drill(_spec(known_server, rate=20, duration_s=0.5, output_len="fixed:2"))
    assert report.sent >= 5 and report.lost == 0 and report.still_open == 0 and report.accounted
