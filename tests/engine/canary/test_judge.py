"""The canary judge: its tests against known answers, its boundaries against their own promise, and (slow)
its error rates over thousands of seeded synthetic canaries whose truth is known."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from engine.canary.judge import (JudgeConfig, Samples, SequentialJudge, error_test, look_level, shift_test, spending,
                                 step_verdict)
from engine.router.samples import Sample
from harness.canary import SHARED_CORES_JUDGE as SHARED

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from canary_judge import SCENARIOS, simulate  # noqa: E402


def test_shift_test_finds_a_known_shift_and_brackets_it():
    rng = np.random.default_rng(0)
    base = rng.lognormal(0, 0.4, 400)
    slow = 1.5 * rng.lognormal(0, 0.4, 200)
    r = shift_test(slow, base, math.log1p(0.10), 0.001)
    assert r.fail and not r.clear_pass and r.p_value < 0.001
    assert r.low < math.log(1.5) < r.high and abs(r.estimate - math.log(1.5)) < 0.1
    same = shift_test(rng.lognormal(0, 0.4, 400), base, math.log1p(0.10), 0.001)
    assert not same.fail and same.clear_pass and same.low < 0 < same.high


def test_shift_test_bounds_are_the_order_statistics_of_the_pairwise_differences():
    rng = np.random.default_rng(1)
    x, y = rng.lognormal(0, 0.5, 30), rng.lognormal(0, 0.5, 40)
    d = np.sort((np.log(x)[:, None] - np.log(y)[None, :]).ravel())
    level = 0.01
    k = math.floor(len(d) / 2 - stats.norm.isf(level) * math.sqrt(30 * 40 * 71 / 12))
    r = shift_test(x, y, 0.1, level)
    assert r.low == pytest.approx(d[k - 1], abs=1e-7) and r.high == pytest.approx(d[len(d) - k], abs=1e-7)
    assert r.estimate == pytest.approx(float(np.median(d)), abs=1e-7)


def test_zero_baseline_errors_against_three_canary_errors_is_judged_by_its_probability():
    """Kayenta scores this Pass (spinnaker #5622); the exact test sees p = (n_c / (n_c + n_b))^3."""
    r = error_test(3, 300, 0, 5700, ratio=1.0, excess=0.01, level=0.001)
    assert r.p_value == pytest.approx(0.5 * 0.05 ** 3) and r.fail  # mid-p: none more extreme, half of this one
    quiet = error_test(0, 300, 0, 5700, ratio=1.0, excess=0.01, level=0.001)
    assert quiet.p_value == 1.0 and not quiet.fail and quiet.high > 0.01  # 300 requests cannot yet prove < 1 %


def test_a_latency_fails_when_slower_than_the_baseline_and_by_more_than_the_margin():
    """With 4,000 requests a side a 5 % slower canary is surely slower, but within the 10 % margin: no fail (and a
    clear pass: its upper bound is under the margin); a 15 % slower one fails although its lower bound (about 11 %)
    is barely past the margin; and an identical one neither fails nor is judged slower."""
    rng = np.random.default_rng(8)
    base = rng.lognormal(0, 0.5, 4000)
    margin, level = math.log1p(0.10), 0.001
    within = shift_test(1.05 * rng.lognormal(0, 0.5, 4000), base, margin, level)
    assert not within.fail and within.clear_pass and within.p_value < level  # slower, yet allowed
    beyond = shift_test(1.15 * rng.lognormal(0, 0.5, 4000), base, margin, level)
    assert beyond.fail and beyond.low > 0 and beyond.estimate > margin
    same = shift_test(rng.lognormal(0, 0.5, 4000), base, margin, level)
    assert not same.fail and same.p_value > level


def test_an_identical_canary_is_rolled_back_within_its_share_of_alpha_however_often_it_is_looked_at():
    """400 seeded steps of an identical canary looked at every 10 requests over a 200-request horizon (20 looks):
    the TTFT test, testing against no shift, fails in about its share of alpha, no more (not alpha x 20)."""
    config = JudgeConfig()
    share = config.alpha * (1 - config.error_alpha_share) / 3
    rng = np.random.default_rng(9)
    failed = 0
    for _ in range(400):
        canary, baseline = rng.lognormal(0, 0.5, 200), rng.lognormal(0, 0.5, 600)
        judge = SequentialJudge(config, horizon=200)
        for seen in range(20, 201, 10):
            c = Samples(np.ones(seen, bool), canary[:seen], canary[:seen], canary[:seen])
            b = Samples(np.ones(3 * seen, bool), baseline[: 3 * seen], baseline[: 3 * seen], baseline[: 3 * seen])
            if next(v for v in judge.look(c, b, bounds=False) if v.metric == "ttft").verdict == "fail":
                failed += 1
                break
    assert failed / 400 <= share + 0.01, (failed, share)


def test_a_step_s_horizon_spends_its_whole_alpha_by_its_end():
    """A step that will see 120 canary requests spends all of each metric's alpha by the 120th; with the fixed
    default horizon (300) it would have spent about half."""
    rng = np.random.default_rng(10)
    data = Samples(np.ones(120, bool), *(rng.lognormal(0, 0.3, 120) for _ in range(3)))
    stepped, fixed = SequentialJudge(JudgeConfig(), horizon=120), SequentialJudge(JudgeConfig())
    for seen in (40, 80, 120):
        last_stepped, last_fixed = stepped.look(data.head(seen), data), fixed.look(data.head(seen), data)
    assert sum(v.alpha_spent for v in last_stepped) == pytest.approx(JudgeConfig().alpha)
    assert sum(v.alpha_spent for v in last_fixed) < 0.7 * JudgeConfig().alpha
    assert SequentialJudge(JudgeConfig(), horizon=3).horizon == JudgeConfig().min_samples  # never under min_samples


def test_the_spending_boundaries_keep_their_promise():
    """Brownian paths under H0 cross the boundaries of 19 looks with the probability alpha, not alpha / 19."""
    looks = tuple((i + 2) / 20 for i in range(19))
    z = np.array([stats.norm.isf(look_level(0.0125, looks[: k + 1])) for k in range(len(looks))])
    rng = np.random.default_rng(0)
    paths = np.cumsum(rng.normal(size=(200_000, len(looks))) * np.sqrt(np.diff((0.0, *looks))), axis=1)
    crossed = float(((paths / np.sqrt(looks)) >= z).any(axis=1).mean())
    assert abs(crossed - 0.0125) < 0.0015, crossed
    bonferroni = spending(0.0125, 1.0) - spending(0.0125, 0.95)  # the last look's share, tested alone
    assert look_level(0.0125, looks) > 4 * bonferroni  # far less conservative


def test_no_data_is_no_pass_and_nothing_new_spends_nothing():
    judge = SequentialJudge(JudgeConfig(min_samples=20, horizon=100))
    few = Samples.of([Sample(group="c", ok=True, ttft=0.1, tpot=0.01, e2e=1.0)] * 5)
    verdicts = judge.look(few, few)
    assert step_verdict(verdicts) == "inconclusive" and all(v.p_value is None for v in verdicts)
    rng = np.random.default_rng(3)
    some = Samples(np.ones(50, bool), rng.lognormal(0, 0.3, 50), rng.lognormal(0, 0.3, 50), rng.lognormal(0, 0.3, 50))
    first = judge.look(some, some)
    again = judge.look(some, some)
    assert again == first and first[0].alpha_spent > 0


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.05, 0.25, 0.5])
def test_simulated_canaries_meet_the_issue_rates(share):
    """1500 seeded runs each, at a 5, 25 and 50 % canary step: false rollbacks <= 5 % and a 30 % slower TTFT caught
    within 200 canary requests >= 95 %; the threshold gates roll back more good canaries and catch fewer slow ones."""
    runs, at = 1500, {"canary_share": share}
    good = simulate(SCENARIOS["good, 1 % errors"].model_copy(update=at), runs, seed=11)
    slow = simulate(SCENARIOS["slow"].model_copy(update=at), runs, seed=12)
    assert good.judge_fail <= 0.05 and good.judge_pass >= 0.95, good
    assert slow.judge_fail >= 0.95, slow
    assert good.thresholds_fail > good.judge_fail and slow.thresholds_fail < slow.judge_fail


@pytest.mark.slow
@pytest.mark.parametrize("share", [
    0.05,
    pytest.param(0.25, marks=pytest.mark.xfail(strict=True, reason="issue #42: 94.0 % in 2,000 runs, target 95 %")),
    pytest.param(0.5, marks=pytest.mark.xfail(strict=True, reason="issue #42: 71.6 % in 2,000 runs, target 95 %")),
])
def test_simulated_erroring_canaries_are_caught(share):
    """2 % errors against none caught within 300 canary requests in >= 95 % of 1500 seeded runs; the larger shares
    fall short (see README: two errors against none cannot be told from chance at the level left)."""
    errors = simulate(SCENARIOS["errors"].model_copy(update={"canary_share": share}), 1500, seed=13)
    assert errors.judge_fail >= 0.95, errors


def test_a_long_schedule_of_looks_needs_no_deep_recursion():
    """More looks than Python's recursion limit (a large horizon, a look per request) still get a boundary."""
    looks = tuple(round((i + 1) / 1100, 6) for i in range(1100))
    level = look_level(0.01, looks)
    assert 0 < level < 0.01


def _requests(rng: np.random.Generator, n: int, tpot: np.ndarray) -> Samples:
    """n successful 8-token requests as the router samples them: TTFT, that TPOT, e2e = TTFT + 7 TPOT."""
    ttft = 0.015 * rng.lognormal(0, 0.3, n)
    return Samples(np.ones(n, bool), ttft, tpot, ttft + 7 * tpot)


def _paced(rng: np.random.Generator, n: int, scale: float = 0.0025) -> np.ndarray:
    return scale * rng.lognormal(0, 0.4, n)


def _bursts(rng: np.random.Generator, n: int) -> np.ndarray:
    """What the router reads when a request's events came in one read: its parse time per event (20-60 us)."""
    return rng.uniform(20e-6, 60e-6, n)


def test_burst_delivered_tpots_do_not_fail_an_identical_canary():
    """The flake of test_a_healthy_canary_passes_and_is_promoted (TPOT +991 %, stopped early at 1.3 s): in one
    second the stable member delivered most answers in one burst (TPOT ~40 us), the canary's member paced them
    (~2.5 ms); 70 % against 10 % bursts, as a recorded reproduction had at its failing look (69 % against 16 %).
    Both groups decode alike; counting bursts as TPOTs fails the canary at the first look."""
    rng = np.random.default_rng(5)
    canary = _requests(rng, 50, np.concatenate([_paced(rng, 45), _bursts(rng, 5)]))
    baseline = _requests(rng, 50, np.concatenate([_paced(rng, 15), _bursts(rng, 35)]))
    counted = SequentialJudge(SHARED.model_copy(update={"tpot_floor_s": 0.0})).look(canary, baseline)
    tpot = next(v for v in counted if v.metric == "tpot")
    assert tpot.verdict == "fail" and tpot.estimate > 5, tpot  # the mechanism: bursts read as a >5x slower canary
    judge = SequentialJudge(SHARED)
    first = {v.metric: v for v in judge.look(canary, baseline)}
    assert first["tpot"].verdict == "inconclusive" and first["tpot"].baseline_n == 15  # not a pass without 20 a side
    assert {m: v.verdict for m, v in first.items() if m != "tpot"} == {"ttft": "pass", "e2e": "pass", "errors": "pass"}
    # past the horizon the TPOT gets its one test once the baseline has 20 paced requests
    more = _requests(rng, 20, np.concatenate([_paced(rng, 10), _bursts(rng, 10)]))
    grown = Samples(*(np.concatenate([getattr(baseline, f), getattr(more, f)]) for f in ("ok", "ttft", "tpot", "e2e")))
    later = {v.metric: v for v in judge.look(canary, grown)}
    assert later["tpot"].verdict == "pass" and later["tpot"].baseline_n == 25
    assert step_verdict(list(later.values())) == "pass"
    assert judge.look(canary, grown) == list(later.values())  # final: nothing re-tested


def test_a_slow_canary_still_fails_on_tpot_against_a_bursty_baseline():
    """Dropping bursts cannot hide a slow decode: a canary 4x slower per token (paced) fails TPOT at the first
    look with the shared-cores margins, whether the baseline's bursts are counted or not; and a canary whose
    every answer came in a burst has no TPOT evidence, so its TPOT cannot pass."""
    rng = np.random.default_rng(6)
    baseline = _requests(rng, 50, np.concatenate([_paced(rng, 24), _bursts(rng, 26)]))
    slow = _requests(rng, 40, _paced(rng, 40, scale=0.010))
    verdicts = {v.metric: v for v in SequentialJudge(SHARED).look(slow, baseline)}
    assert verdicts["tpot"].verdict == "fail" and verdicts["tpot"].ci_low > 1.0, verdicts["tpot"]
    shipped = {v.metric: v for v in SequentialJudge(JudgeConfig(horizon=30)).look(slow, baseline)}
    assert shipped["tpot"].verdict == "fail"
    bursting = _requests(rng, 40, _bursts(rng, 40))
    verdicts = {v.metric: v for v in SequentialJudge(SHARED).look(bursting, baseline)}
    assert verdicts["tpot"].verdict == "inconclusive" and verdicts["tpot"].canary_n == 0
