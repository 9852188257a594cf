"""The canary judge: per-request samples of the canary and its stable baseline -> a verdict per metric, with
its evidence, valid however often the judge looks during a hold.

- Latency (TTFT, TPOT, end-to-end): Mann-Whitney U on log latency, so the shift is relative and a rank test
  needs no distribution; the Hodges-Lehmann estimate of the shift (median of the pairwise differences) and
  its distribution-free confidence bounds (order statistics of those differences). "fail" when the canary is
  slower than the baseline at this look's level (the lower bound lies above 0) and by more than the allowed
  degradation (the estimate lies above it); "pass" when the upper bound lies below the allowed degradation.
  Why not fail only when the lower bound clears the margin: that tests a canary exactly at the margin, so a good
  canary (no shift at all) was almost never rolled back (0.0 % against a 5 % allowance) while a 30 % slower one
  slipped through a quarter of the time at a 25 % step (benchmarks/canary_judge.py). Testing against no shift
  spends the false-rollback budget on the canaries it is meant for: a good one fails with at most the metric's
  share of alpha, however often the judge looks; one at the margin fails about half the time.
- Errors (router errors, timeouts, and 5xx answers retried elsewhere): a conditional binomial test of
  H0 "canary rate <= error_ratio x baseline rate": given x errors in all, the canary's share of them is
  Binomial(x, n_c r / (n_c r + n_b)) under H0, read with the mid-p value (P(more) + P(as many) / 2): the exact
  p of so discrete a test holds its level far below alpha (0.6 % false rollbacks against 1.5 %), the mid-p
  close to it. 0 baseline errors against 3 canary errors is judged by its probability, not by an undefined
  ratio. "pass" early when the canary rate's exact (Clopper-Pearson) upper bound is within `error_excess` of
  the baseline rate.
- Errors carry over from step to step (`carry_errors`): a step's error test also weighs the earlier steps' counts,
  each step a stratum of its own (the canary's errors summed over strata, each Binomial(x_k, share_k) under H0,
  their sum's law by convolution), so a canary that erred at 5 % still answers for it at 25 %. Why: one step's
  counts cannot do it. With 2 % errors against none and 300 canary requests, the most powerful unbiased test of
  the step's counts alone (randomized Fisher, all of alpha, one look) catches 97.8 % at 25 % and 87.2 % at 50 %
  (benchmarks/canary_judge.py, `error tests`); the canary's own earlier requests are the evidence that is left.
  Why strata, not the stable group's history before the canary: a stratum per step assumes only that both
  groups share a rate within a step, so a load or an upstream fault that raises every error rate between steps
  fails no canary; a rate taken from before the canary would. A step whose baseline is borrowed (100 %, no
  concurrent stable traffic) does not carry the stratum that baseline came from: no sample is counted twice.
  The repeated looks keep their guarantee: the carried counts make successive looks' statistics more alike
  (correlation sqrt((t0 + s) / (t0 + t)) instead of sqrt(s / t)), and for Gaussian statistics of the same
  variance more alike means less likely to cross the same boundaries somewhere (Slepian's inequality), so the
  boundaries computed for a step alone stay valid, only conservative.
- Sequential stopping by alpha spending (Lan-DeMets): the error test gets `error_alpha_share` of alpha, each
  latency metric a third of the rest, spent over the information fraction t = canary requests / horizon, the
  step's horizon being the canary requests its hold is expected to see (engine/canary/rollout.py measures the
  canary's arrival rate), so a step spends its whole alpha by its end whatever its share; by the Pocock-type
  function a ln(1 + (e - 1) t) or the O'Brien-Fleming-type 2 - 2 Phi(z_(a/2) / sqrt(t)) (`spending`). At each
  look the boundary is the one whose crossing probability, for a test statistic that moves as Brownian motion in
  t (as a rank statistic's z does) and has not crossed at an earlier look, equals the alpha spent since; it is
  found by propagating the statistic's density on a grid from look to look. So however often and whenever the
  judge looks, the chance that a canary no worse than its baseline fails a metric in a step stays within that
  metric's share of alpha, without the loss of a Bonferroni split over looks. At the horizon the verdict is final: "pass" when
  nothing failed.
- No data, no pass: a metric with fewer than `min_samples` on either side is "inconclusive". One that had too
  few when the horizon was reached gets its one test, at the last look's level, once it has them.
- A TPOT is measured only where the tokens after the first reached the router spread out: the router's TPOT of
  a request is the span of its reads of the upstream events / (tokens - 1), so a request whose events came in
  one burst (its member's event loop, or the router, off the CPU while the engine decoded the whole answer)
  reads 20-60 us, the router's parse time per event, not a decode pace. Such bursts come in episodes of one
  member process; on shared cores a quarter of all requests may be bursts and, within a second, most of one
  group's and few of the other's: a log-scale rank test then reads a 10-50x shift between identical groups.
  TPOTs under `tpot_floor_s` (no engine decodes a token in 100 us) are therefore left out of the TPOT test,
  as a one-token answer's is; so a side in a burst episode has fewer TPOTs, never a false 50x. Those requests'
  TTFT and end-to-end latency stay judged and carry any delay (in a burst the TTFT spans the whole decode).

Normal approximations (the U statistic's null distribution) are good from about 20 samples a side, which is
why `min_samples` defaults to 20.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from scipy import special, stats

from engine.router.samples import Sample

Verdict = Literal["pass", "fail", "inconclusive"]
LATENCY_METRICS = ("ttft", "tpot", "e2e")
METRICS = (*LATENCY_METRICS, "errors")


class JudgeConfig(BaseModel):
    """How much degradation a canary may show, and the false-rollback budget of one step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(0.05, gt=0, lt=0.5, description="chance that a canary no worse than its baseline (latency "
                                                           "no slower, errors no more often than error_ratio x) is "
                                                           "rolled back in one step, all metrics together")
    error_alpha_share: float = Field(0.85, gt=0, lt=1, description="the error test's share of alpha; the three latency "
                                                                   "metrics split the rest (rare errors need the larger "
                                                                   "share: one canary error against none in 19x the "
                                                                   "requests, a 5 % step's mid-p 0.025, is rejected at "
                                                                   "the last look only from 0.85; latency shifts stand "
                                                                   "out at a small level)")
    ttft_margin: float = Field(0.10, ge=0, description="allowed relative TTFT degradation (0.10: 10 % slower)")
    tpot_margin: float = Field(0.10, ge=0, description="allowed relative TPOT degradation")
    e2e_margin: float = Field(0.10, ge=0, description="allowed relative end-to-end latency degradation")
    error_ratio: float = Field(1.0, ge=1, description="H0 of the error test: canary error rate <= this x the baseline's")
    error_excess: float = Field(0.01, gt=0, lt=1, description="an early error pass needs the canary rate's upper "
                                                              "bound within this of the baseline rate")
    min_samples: int = Field(20, ge=5, description="samples per side before a metric can pass (fewer: inconclusive)")
    horizon: int = Field(300, ge=20, description="canary samples over which a step's alpha is spent when the step's "
                                                 "own horizon is not known (its expected canary requests); the "
                                                 "verdict is final there")
    spending: Literal["pocock", "obrien-fleming"] = Field(
        "obrien-fleming", description="how alpha is spent over a step: obrien-fleming keeps most of it for the end "
                                      "(more power by the horizon: a few errors can be told from chance only there), "
                                      "pocock spends it evenly (earlier verdicts, less power at the end)")
    carry_errors: bool = Field(True, description="a step's error test also weighs the earlier steps' error counts, "
                                                 "a stratum per step (see the module's notes); False: the step's own")
    tpot_floor_s: float = Field(1e-4, ge=0, description="a TPOT under this is a burst delivery (all the tokens after "
                                                       "the first read at once), not a decode pace: not measured")

    def margin(self, metric: str) -> float:
        return getattr(self, f"{metric}_margin")


@dataclass(frozen=True)
class Samples:
    """One side's samples as arrays (NaN where a latency was not measured): what the judge computes on."""

    ok: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray

    @classmethod
    def of(cls, samples: list[Sample]) -> "Samples":
        def col(name: str) -> np.ndarray:
            return np.array([math.nan if getattr(s, name) is None else getattr(s, name) for s in samples], dtype=float)

        return cls(np.array([s.ok for s in samples], dtype=bool), col("ttft"), col("tpot"), col("e2e"))

    def __len__(self) -> int:
        return len(self.ok)

    def errors(self) -> int:
        return int(len(self.ok) - self.ok.sum())

    def head(self, n: int) -> "Samples":
        return Samples(self.ok[:n], self.ttft[:n], self.tpot[:n], self.e2e[:n])

    def latencies(self, metric: str) -> np.ndarray:
        """The metric's values of the successful requests that measured it."""
        values = getattr(self, metric)
        return values[self.ok & ~np.isnan(values)]


class ErrorCounts(BaseModel):
    """One step's error counts on both sides: what a later step's error test carries as a stratum."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    canary_errors: int = Field(ge=0)
    canary_n: int = Field(ge=0)
    baseline_errors: int = Field(ge=0)
    baseline_n: int = Field(ge=0)

    @model_validator(mode="after")
    def _errors_within_requests(self) -> "ErrorCounts":
        if self.canary_errors > self.canary_n or self.baseline_errors > self.baseline_n:
            raise ValueError(f"more errors than requests: {self}")
        return self

    @classmethod
    def of(cls, canary: Samples, baseline: Samples) -> "ErrorCounts":
        return cls(canary_errors=canary.errors(), canary_n=len(canary), baseline_errors=baseline.errors(),
                   baseline_n=len(baseline))


class MetricVerdict(BaseModel):
    """One row of the judge table: a metric's verdict in a step and what it rests on."""

    step: int
    metric: str
    verdict: Verdict
    why: str = Field(description="what decided it")
    clear: bool = Field(False, description="the verdict rests on a confidence bound clear of the margin, so the step "
                                           "may end on it before its hold time")
    canary_n: int
    baseline_n: int
    estimate: float | None = Field(None, description="latency: Hodges-Lehmann relative shift (0.3 = 30 % slower); "
                                                     "errors: canary rate - baseline rate")
    ci_low: float | None = Field(None, description="lower confidence bound of the estimate at this look's level")
    ci_high: float | None = Field(None, description="upper confidence bound of the estimate at this look's level")
    margin: float = Field(description="allowed degradation (relative for latency, the rate ratio for errors)")
    p_value: float | None = Field(None, description="one-sided p of H0 'no slower than the baseline' (latency) or "
                                                    "'no more errors than allowed' (errors)")
    carried_steps: int = Field(0, description="errors: earlier steps whose counts the test weighed with this one's")
    alpha_look: float = Field(description="the level this look tested at")
    alpha_spent: float = Field(description="alpha spent on this metric in the step so far")


def spending(alpha: float, t: float, kind: str = "pocock") -> float:
    """Lan-DeMets spending: alpha spent by information fraction t in [0, 1], Pocock- or O'Brien-Fleming-type."""
    t = min(max(t, 0.0), 1.0)
    if kind == "obrien-fleming":
        return 0.0 if t <= 0.0 else float(2.0 * stats.norm.sf(stats.norm.isf(alpha / 2.0) / math.sqrt(t)))
    return alpha * math.log(1.0 + (math.e - 1.0) * t)


_GRID = np.linspace(-8.0, 8.0, 801)  # the statistic S_t ~ N(0, t), t <= 1, in units of its end sd
_STEP = float(_GRID[1] - _GRID[0])


Boundary = tuple[float, np.ndarray]  # a look's z boundary, and the density of the paths that crossed none so far
_MEMO: OrderedDict[tuple, Boundary] = OrderedDict()  # (alpha, looks) -> Boundary: simulations repeat schedules
_MEMO_SIZE = 4096


def next_boundary(alpha: float, looks: tuple[float, ...], before: Boundary | None, kind: str = "pocock") -> Boundary:
    """The boundary at the last of `looks` (information fractions, increasing), given `before`, the result at
    the looks before it (None at the first), under H0. Iterative, so a long schedule needs no deep recursion;
    memoised, so seeded simulations compute each schedule once."""
    key = (alpha, looks, kind)
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key]
    t = looks[-1]
    spend = spending(alpha, t, kind) - spending(alpha, looks[-2] if len(looks) > 1 else 0.0, kind)
    if before is None:
        c = float(stats.norm.isf(max(spend, 1e-300)))
        density = stats.norm.pdf(_GRID, scale=math.sqrt(t))
    else:
        sd = math.sqrt(t - looks[-2])
        mass = before[1] * _STEP

        def crossing(z: float) -> float:
            return float(mass @ special.ndtr((_GRID - z * math.sqrt(t)) / sd))  # the normal's upper tail

        lo, hi = -2.0, 12.0
        for _ in range(50):  # crossing() falls as z rises
            mid = 0.5 * (lo + hi)
            if crossing(mid) > spend:
                lo = mid
            else:
                hi = mid
        c = hi
        density = _kernel(round(sd, 9)) @ mass
    result = (c, np.where(_GRID < c * math.sqrt(t), density, 0.0))
    _MEMO[key] = result
    if len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return result


@functools.lru_cache(maxsize=64)
def _kernel(sd: float) -> np.ndarray:
    """The transition density on _GRID of a Brownian increment with this sd (looks at even spacing share one)."""
    return stats.norm.pdf((_GRID[:, None] - _GRID[None, :]) / sd) / sd


def look_level(alpha: float, looks: tuple[float, ...], kind: str = "pocock") -> float:
    """The nominal one-sided level a test uses at the last of `looks` (its boundary as a tail probability)."""
    state = None
    for k in range(1, len(looks) + 1):
        state = next_boundary(alpha, looks[:k], state, kind)
    return float(stats.norm.sf(state[0]))


def _kth_difference(x: np.ndarray, y_sorted: np.ndarray, k: int) -> float:
    """The k-th smallest (1-based) of the pairwise differences x_i - y_j, by bisection on counts."""
    lo, hi = float(x.min() - y_sorted[-1]), float(x.max() - y_sorted[0])
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _count_at_most(x, y_sorted, mid) >= k:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(1.0, abs(hi)):
            break
    return hi


def _count_at_most(x: np.ndarray, y_sorted: np.ndarray, d: float) -> int:
    """#{(i, j): x_i - y_j <= d}."""
    return int(len(y_sorted) * len(x) - np.searchsorted(y_sorted, x - d, side="left").sum())


def _count_below(x: np.ndarray, y_sorted: np.ndarray, d: float) -> int:
    """#{(i, j): x_i - y_j < d}."""
    return int(len(y_sorted) * len(x) - np.searchsorted(y_sorted, x - d, side="right").sum())


class ShiftTest(BaseModel):
    """Mann-Whitney / Hodges-Lehmann on log samples at one level (shifts in log units)."""

    fail: bool = Field(description="slower than the baseline at this level (the lower confidence bound lies above 0) "
                                   "and by more than the margin (the estimate lies above it)")
    clear_pass: bool = Field(description="the upper confidence bound lies below the margin")
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    p_value: float


def shift_test(canary: np.ndarray, baseline: np.ndarray, margin_log: float, level: float,
               bounds: bool = True) -> ShiftTest:
    """One-sided tests of the log shift at `level`: slower than the baseline with an estimate above `margin_log`
    (fail), or an upper bound below it (clear pass). The bounds are the k-th smallest and k-th largest pairwise
    differences, k from the U statistic's normal approximation at that level; the verdicts need only counts, so
    `bounds=False` (the simulations) skips locating them."""
    x, y = np.log(canary), np.sort(np.log(baseline))
    n, m = len(x), len(y)
    nm = n * m
    sigma = math.sqrt(nm * (n + m + 1) / 12.0)
    k = math.floor(nm / 2.0 - stats.norm.isf(level) * sigma)  # rank of the lower bound (< 1: unbounded)
    at_most_zero = _count_at_most(x, y, 0.0)
    slower = k >= 1 and at_most_zero < k  # lower bound d_(k) > 0
    beyond = 2 * _count_at_most(x, y, margin_log) < nm  # more than half the differences exceed it: HL > margin
    clear_pass = k >= 1 and _count_below(x, y, margin_log) >= nm - k + 1  # upper bound d_(nm-k+1) < margin
    u = nm - at_most_zero  # pairs with x_i > y_j: U of the canary against the baseline
    p_value = float(stats.norm.sf((u - nm / 2.0 - 0.5) / sigma))
    fail = slower and beyond
    estimate = low = high = None
    if bounds:
        estimate = 0.5 * (_kth_difference(x, y, (nm + 1) // 2) + _kth_difference(x, y, nm // 2 + 1))
        if k >= 1:
            low, high = _kth_difference(x, y, k), _kth_difference(x, y, nm - k + 1)
    return ShiftTest(fail=fail, clear_pass=clear_pass, estimate=estimate, low=low, high=high, p_value=p_value)


class ErrorTest(BaseModel):
    fail: bool
    clear_pass: bool
    estimate: float
    low: float
    high: float
    p_value: float


def error_test(canary_errors: int, canary_n: int, baseline_errors: int, baseline_n: int, ratio: float,
               excess: float, level: float, carried: Sequence[ErrorCounts] = ()) -> ErrorTest:
    """Conditional test of H0 "canary rate <= ratio x baseline rate" at `level` (its mid-p value), over this
    step's counts and the `carried` earlier steps', a stratum each; and Clopper-Pearson bounds of this step's
    canary rate at the same level (reported less the baseline rate)."""
    strata = [*carried, ErrorCounts(canary_errors=canary_errors, canary_n=canary_n, baseline_errors=baseline_errors,
                                    baseline_n=baseline_n)]
    law = np.ones(1)  # the law of the canary's errors summed over strata, given each stratum's errors in all
    for s in strata:
        total = s.canary_errors + s.baseline_errors
        if total and s.canary_n:
            share = ratio * s.canary_n / (ratio * s.canary_n + s.baseline_n)
            law = np.convolve(law, stats.binom.pmf(np.arange(total + 1), total, share))
    seen = sum(s.canary_errors for s in strata)
    p_value = 1.0
    if seen > 0:
        p_value = float(min(1.0, law[seen + 1:].sum() + 0.5 * law[seen]))
    base = baseline_errors / baseline_n
    upper = 1.0 if canary_errors >= canary_n else float(stats.beta.isf(level, canary_errors + 1, canary_n - canary_errors))
    lower = 0.0 if canary_errors == 0 else float(stats.beta.ppf(level, canary_errors, canary_n - canary_errors + 1))
    return ErrorTest(fail=p_value <= level, clear_pass=upper <= base + excess, estimate=canary_errors / canary_n - base,
                     low=lower - base, high=upper - base, p_value=p_value)


class SequentialJudge:
    """One step's judge: call `look` with all the step's samples so far, as often as wanted. A look with more
    canary requests than the last is a new look of the spending plan; a metric's verdict is final once it
    failed, or passed at the horizon."""

    def __init__(self, config: JudgeConfig, step: int = 0, horizon: int | None = None) -> None:
        """`horizon`: the canary requests this step is expected to see (config.horizon when None)."""
        self.config, self.step = config, step
        self.horizon = max(config.min_samples, horizon) if horizon is not None else config.horizon
        self.alpha_of = {m: config.alpha * (config.error_alpha_share if m == "errors" else
                                            (1 - config.error_alpha_share) / len(LATENCY_METRICS)) for m in METRICS}
        self._looks: tuple[float, ...] = ()
        self._boundaries: dict[float, Boundary] = {}  # per alpha share: the state after the latest look
        self._final: dict[str, MetricVerdict] = {}
        self._last: list[MetricVerdict] = []

    def look(self, canary: Samples, baseline: Samples, bounds: bool = True,
             carried: Sequence[ErrorCounts] = ()) -> list[MetricVerdict]:
        """`carried`: the earlier steps' error counts, weighed by the error test when `carry_errors` is on (none
        whose baseline samples are among `baseline`: the caller leaves those out)."""
        carried = tuple(carried) if self.config.carry_errors else ()
        t = round(min(1.0, len(canary) / self.horizon), 6)  # rounded: schedules repeat exactly (memo)
        if len(canary) >= self.config.min_samples and (not self._looks or t > self._looks[-1]):
            self._looks += (t,)
            for alpha in set(self.alpha_of.values()):
                self._boundaries[alpha] = next_boundary(alpha, self._looks, self._boundaries.get(alpha),
                                                        self.config.spending)
        elif self._last and len(canary) >= self.config.min_samples and self._looks[-1] < 1.0:
            return self._last  # no new canary request since the last look: nothing new to spend
        # past the horizon no look is added: the final verdicts stand, and a metric that had too few samples
        # for its test gets that one test (at the last look's level) once it has them
        looking = bool(self._looks) and len(canary) >= self.config.min_samples
        out = []
        for metric in METRICS:
            level = float(stats.norm.sf(self._boundaries[self.alpha_of[metric]][0])) if looking else 0.0
            verdict = self._final.get(metric) or self._look_metric(metric, canary, baseline, level, bounds, carried)
            if verdict.verdict == "fail" or (verdict.verdict == "pass" and t >= 1.0):
                self._final[metric] = verdict
            out.append(verdict)
        self._last = out
        return out

    def _measured(self, metric: str, samples: Samples) -> np.ndarray:
        """The latencies the test compares: without the TPOTs of burst deliveries (see the module's notes)."""
        values = samples.latencies(metric)
        return values[values >= self.config.tpot_floor_s] if metric == "tpot" else values

    def _look_metric(self, metric: str, canary: Samples, baseline: Samples, level: float, bounds: bool,
                     carried: tuple[ErrorCounts, ...]) -> MetricVerdict:
        c = self.config
        if metric == "errors":
            cv, bv, margin = canary.ok, baseline.ok, c.error_ratio
        else:
            cv, bv, margin = self._measured(metric, canary), self._measured(metric, baseline), c.margin(metric)
        n, m = len(cv), len(bv)
        t = self._looks[-1] if self._looks else 0.0
        common = dict(step=self.step, metric=metric, canary_n=n, baseline_n=m, margin=margin,
                      alpha_spent=spending(self.alpha_of[metric], t, c.spending))
        if n < c.min_samples or m < c.min_samples or level <= 0.0:
            why = f"fewer than {c.min_samples} samples a side"
            if metric == "tpot":
                why += f" (TPOTs under {c.tpot_floor_s * 1e6:g} us are burst deliveries, not measured)"
            return MetricVerdict(**common, verdict="inconclusive", why=why, alpha_look=0.0)
        if metric == "errors":
            e = error_test(n - int(cv.sum()), n, m - int(bv.sum()), m, c.error_ratio, c.error_excess, level, carried)
            fail, clear, est, low, high, p = e.fail, e.clear_pass, e.estimate, e.low, e.high, e.p_value
            common["carried_steps"] = len(carried)
        else:
            s = shift_test(cv, bv, math.log1p(margin), level, bounds)
            fail, clear, p = s.fail, s.clear_pass, s.p_value
            est, low, high = (None if v is None else math.expm1(v) for v in (s.estimate, s.low, s.high))
        if fail and metric == "errors":
            earlier = sum(k.canary_errors for k in carried)
            verdict, why = "fail", f"more errors than allowed: p {p:.2g} <= {level:.2g}" + (
                f" ({earlier} canary errors in {sum(k.canary_n for k in carried)} requests carried from "
                f"{len(carried)} earlier step{'s' if len(carried) > 1 else ''})" if carried else "")
        elif fail:
            verdict, why = "fail", f"slower than the baseline (p {p:.2g} <= {level:.2g}) by more than allowed"
        elif clear:
            verdict, why = "pass", "within the allowed degradation at this look's level"
        elif t >= 1.0:
            verdict, why = "pass", f"no evidence of harm over the horizon ({self.horizon} canary requests)"
        else:
            verdict, why = "inconclusive", "neither bound clear of the margin yet"
        return MetricVerdict(**common, verdict=verdict, why=why, clear=bool(fail or clear), estimate=est, ci_low=low,
                             ci_high=high, p_value=p, alpha_look=level)


def step_verdict(verdicts: list[MetricVerdict]) -> Verdict:
    """fail if any metric failed, pass if all passed, else inconclusive."""
    kinds = {v.verdict for v in verdicts}
    return "fail" if "fail" in kinds else "pass" if kinds == {"pass"} else "inconclusive"
