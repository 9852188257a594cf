"""The capacity plan from profiles and a forecast: queueing counted, every number with its reason, the warm pool
ahead of ramps, the same plan for the same inputs, and clear refusals of what cannot be planned."""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from engine.capacity.forecast import Forecast, TidalShape, from_csv
from engine.capacity.plan import SLO, PlanRefused, erlang_c, plan, predict_decode, predict_prefill, prefill_members
from engine.runtime.process import tideflow_argv
from tests.engine.capacity.shapes import SPEC, shape

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_erlang_c_matches_its_closed_forms():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # (a^2/2! * 2/(2-1)) / (1 + a + that)
    assert erlang_c(10, 0.5) < 1e-6


def test_queueing_takes_a_member_that_throughput_alone_would_not():
    # 9 req/s of 256-token prompts against 10 req/s a member: throughput says 1 member, the queue's tail says more
    one = prefill_members(9.0, shape(), SPEC)
    assert one.members >= 2 and one.predicted_p90_s <= SPEC.slo.ttft_p90_s
    assert f"{one.members - 1} would not" in one.reason and "of queue" in one.reason
    low = prefill_members(1.0, shape(), SPEC)
    assert low.members == 1 and "1 keep TTFT p90" in low.reason


def test_predictions_say_when_the_members_cannot_keep_up():
    # the shape's members take 10 prompts of 256 tokens a second: 2 members keep up with 15, 1 does not
    assert predict_prefill(15.0, shape(), SPEC, 1) is None
    two = predict_prefill(15.0, shape(), SPEC, 2)
    assert two.member_rps == pytest.approx(10.0) and two.ttft_p90_s == pytest.approx(two.alone_s + two.queue_p90_s)
    assert predict_decode(500.0, shape(), SPEC, 1) is None  # more sequences than the profile's 32
    one = predict_decode(2.0, shape(), SPEC, 1)
    assert one.kv_tokens == pytest.approx(one.per_member * (256 + 128))


def test_a_correction_takes_members_as_that_much_slower_than_profiled():
    slower = SPEC.model_copy(update={"ttft_correction": 2.0, "itl_correction": 1.5})
    p1, p2 = predict_prefill(4.0, shape(), SPEC, 1), predict_prefill(4.0, shape(), slower, 1)
    assert p2.alone_s == pytest.approx(2 * p1.alone_s) and p2.member_rps == pytest.approx(p1.member_rps)
    assert p2.queue_p90_s == pytest.approx(p1.queue_p90_s)
    d1, d2 = predict_decode(2.0, shape(), SPEC, 1), predict_decode(2.0, shape(), slower, 1)
    assert d2.itl_p90_s > 1.5 * d1.itl_p90_s * 0.999 and d2.per_member > d1.per_member  # slower decode holds more
    assert prefill_members(9.0, shape(), slower).predicted_p90_s > prefill_members(9.0, shape(), SPEC).predicted_p90_s


def test_more_traffic_never_plans_fewer_members():
    counts = [(prefill_members(r, shape(), SPEC).members) for r in (0.5, 2, 5, 9, 15, 30, 60)]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_the_same_inputs_give_the_same_plan_and_ramps_get_a_warm_pool():
    forecast = TidalShape(night_rps=0.5, peak_rps=20.0).forecast()
    first = plan(SPEC, forecast, shape())
    assert first.model_dump_json() == plan(SPEC, forecast, shape()).model_dump_json()
    by_hour = {h.hour: h for h in first.hours}
    assert by_hour[3].members < by_hour[12].members == first.peak_members
    ramps = [h for h in first.hours if by_hour[(h.hour + 1) % 24].members > h.members]
    assert ramps and all(h.warm_pool == by_hour[(h.hour + 1) % 24].members - h.members for h in ramps)
    assert all(h.warm_pool == 0 for h in first.hours if h not in ramps)
    assert first.member_hours == sum(h.members + h.warm_pool for h in first.hours)
    assert all(h.planned_rps == pytest.approx(h.rps * 1.15) for h in first.hours)


def test_a_target_the_shape_cannot_meet_or_a_member_that_does_not_fit_is_refused():
    with pytest.raises(PlanRefused, match="alone takes 100 ms to its first token .* above the TTFT target 50 ms"):
        plan(SPEC.model_copy(update={"slo": SLO(ttft_p90_s=0.05, itl_p90_s=0.04)}), TidalShape().forecast(), shape())
    with pytest.raises(PlanRefused, match="ITL p90 is 12.6 ms with one sequence .* above the target 5.0 ms"):
        plan(SPEC.model_copy(update={"slo": SLO(ttft_p90_s=0.5, itl_p90_s=0.005)}), TidalShape().forecast(), shape())
    small = SPEC.model_copy(update={"member_memory_bytes": 10**9})
    with pytest.raises(PlanRefused, match=r"a prefill member needs 1.47 GB \(weights 0.40 GB \+ buffers 0.00 GB \+ KV 1.07 GB for 65536 tokens\), "
                                          r"0.47 GB more than its 1.00 GB"):
        plan(small, TidalShape().forecast(), shape())
    with pytest.raises(PlanRefused, match="outside the lengths the prefill profile measured"):
        plan(SPEC.model_copy(update={"input_tokens": 4000}), TidalShape().forecast(), shape())


@pytest.mark.parametrize("rows, error", [
    ("", "no rows"), ("hour,rps\n", "no rows"),
    ("\n".join(f"{h},1" for h in range(23)), "no rate for hour(s) 23"),
    ("\n".join(f"{h},1" for h in range(24)) + "\n5,2", "hour 5 appears twice"),
    ("\n".join(f"{h},{-1 if h == 3 else 1}" for h in range(24)), "hour 3: rate -1.0 is not a finite number >= 0"),
    ("\n".join(f"{h},{'nan' if h == 7 else 1}" for h in range(24)), "hour 7: rate nan"),
    ("\n".join(f"{h},1" for h in range(1, 25)), "hour 24 is not 0-23"),
    ("hour,rps\n\n0,one", "line 3 ['0', 'one'] is not `hour,rps`")])
def test_a_bad_forecast_is_refused_naming_what_is_wrong(tmp_path, rows, error):
    path = tmp_path / "f.csv"
    path.write_text(rows)
    with pytest.raises(ValueError, match=re.escape(error)):
        from_csv(path)


def test_a_zone_that_does_not_exist_and_an_all_zero_day_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'Mars/Olympus' is not an IANA timezone"):
        Forecast(hourly_rps=[1.0] * 24, timezone="Mars/Olympus")
    with pytest.raises(ValueError, match="nothing to plan for"):
        Forecast(hourly_rps=[0.0] * 24)
    path = tmp_path / "f.csv"
    path.write_text("hour,rps\n" + "\n".join(f"{h},{h}" for h in range(24)))
    shanghai = from_csv(path, "Asia/Shanghai")
    assert shanghai.timezone == "Asia/Shanghai" and math.isclose(shanghai.hourly_rps[5], 5.0)


def test_the_cli_prints_the_plan_and_refuses_a_bad_forecast_in_one_line(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(shape().model_dump_json())
    argv = ["plan", "--profile", str(profile), "--ttft-ms", "500", "--itl-ms", "40", "--input-tokens", "256",
            "--output-tokens", "128", "--peak-rps", "20"]
    done = subprocess.run(tideflow_argv(*argv, "--out", str(tmp_path / "plan.json")), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| hour | req/s | planned | prefill | decode | P:D |" in done.stdout and "decode at the peak:" in done.stdout
    assert (tmp_path / "plan.json").exists()
    bad = tmp_path / "bad.csv"
    bad.write_text("0,1\n")
    refused = subprocess.run(tideflow_argv(*argv, "--forecast", str(bad)), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no rate for hour(s) 1, 2" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
