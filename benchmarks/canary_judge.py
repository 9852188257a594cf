"""The canary judge against today's threshold gates, on seeded synthetic canaries whose truth is known.

    python benchmarks/canary_judge.py [--runs 2000] [--seed 0] [--share 0.05 0.25 0.5] [--judge '{"spending": "pocock"}']

Each run is one canary step: requests arrive, a share `canary_share` of them to the canary, and both sides
are judged every `look_every` canary requests, as a hold checks every second. The step's horizon is its
length (the canary requests the hold sees: what rollout.py estimates from the canary's arrival rate), so the
judge spends its whole alpha by then. Latencies are log-normal (TTFT median 150 ms, sigma 0.5; TPOT median
20 ms, sigma 0.3; end-to-end = TTFT + TPOT x 32-256 output tokens), errors Bernoulli. Scenarios:
  good   : canary = baseline                          -> rolled back (false rollback) in how many runs
  good, 1 % errors: both sides fail 1 % of requests   -> the same, with the error test at its H0 boundary
  slow   : canary TTFT x 1.3 (every quantile)        -> caught within 200 canary requests in how many
  errors : canary 2 % errors, baseline 0 %           -> caught within 300 canary requests in how many
and, reported without a target: at the margin (TTFT x 1.1, what the margin allows), 15 % slower (TTFT x 1.15
within 400), bimodal (10 % of canary requests 5x slower TTFT, within 400) and 1 % errors against 0.2 % (within
600). Per row: rolled back, the median canary requests to a verdict, and the alpha the judge had spent by its
last look (all metrics; the whole 0.05 when a run reached the step's end undecided). For the error scenarios,
"error tests: best / Fisher" is the power of the randomized one-sided Fisher test on the step's whole sample with
all of alpha, which no unbiased test of the step's counts passes, and of the same test without its coin
(error_power): a target above "best" cannot be met from the step's own counts.
The threshold gates are those of the suite shipped before the judge (deployments/expectations/canary.json at
the time): once the canary has `min_requests` (100) requests, fail at any check where TTFT or TPOT p99 exceeds
1.2x the baseline's or the error rate exceeds the baseline's by 0.5 percentage points (exact p99s, kinder to
them than the histogram quantiles they read).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.canary.judge import ErrorCounts, JudgeConfig, Samples, SequentialJudge, step_verdict  # noqa: E402


class Scenario(BaseModel):
    name: str
    ttft_factor: float = 1.0
    slow_share: float = Field(0.0, ge=0, le=1, description="canary requests whose TTFT is 5x (bimodal latency)")
    error_rate: float = 0.0
    baseline_error_rate: float = 0.0
    canary_share: float = Field(0.05, gt=0, lt=1, description="the step's canary share of the traffic")
    canary_requests: int = Field(400, description="the run ends here (the verdict, or inconclusive)")


SCENARIOS = {
    "good": Scenario(name="good", canary_requests=400),
    "good, 1 % errors": Scenario(name="good, 1 % errors", error_rate=0.01, baseline_error_rate=0.01, canary_requests=400),
    "slow": Scenario(name="slow", ttft_factor=1.3, canary_requests=200),
    "errors": Scenario(name="errors", error_rate=0.02, canary_requests=300),
    "at the margin": Scenario(name="at the margin", ttft_factor=1.1, canary_requests=400),
    "15 % slower": Scenario(name="15 % slower", ttft_factor=1.15, canary_requests=400),
    "bimodal": Scenario(name="bimodal", slow_share=0.1, canary_requests=400),
    "1 % vs 0.2 % errors": Scenario(name="1 % vs 0.2 % errors", error_rate=0.01, baseline_error_rate=0.002,
                                    canary_requests=600),
}
TARGETS = {"good": "<= 5 %", "good, 1 % errors": "<= 5 %", "slow": ">= 95 %", "errors": ">= 95 %"}
THRESHOLD_MIN_REQUESTS = 100
THRESHOLD_P99_RATIO = 1.2
THRESHOLD_ERROR_EXCESS_PP = 0.5


def synthetic(rng: np.random.Generator, n: int, ttft_factor: float, error_rate: float, slow_share: float = 0.0) -> Samples:
    ttft = 0.15 * ttft_factor * rng.lognormal(0.0, 0.5, n)
    ttft *= np.where(rng.random(n) < slow_share, 5.0, 1.0)
    tpot = 0.02 * rng.lognormal(0.0, 0.3, n)
    e2e = ttft + tpot * rng.integers(32, 257, n)
    ok = rng.random(n) >= error_rate
    return Samples(ok, ttft, tpot, e2e)


def threshold_gates(canary: Samples, baseline: Samples) -> str:
    """Today's gates at one check: 'fail', 'pass', or 'inconclusive' below their minimum request count."""
    if len(canary) < THRESHOLD_MIN_REQUESTS:
        return "inconclusive"
    excess = 100.0 * ((~canary.ok).mean() - (~baseline.ok).mean())
    if excess > THRESHOLD_ERROR_EXCESS_PP:
        return "fail"
    for metric in ("ttft", "tpot"):
        c, b = canary.latencies(metric), baseline.latencies(metric)
        if len(c) and len(b) and np.percentile(c, 99) > THRESHOLD_P99_RATIO * np.percentile(b, 99):
            return "fail"
    return "pass"


class ErrorPower(BaseModel):
    best: float = Field(description="the randomized one-sided Fisher test: no unbiased test of these counts passes it")
    fisher: float = Field(description="the same test without its coin: reject only when the exact p-value <= alpha")


def error_power(s: Scenario, alpha: float) -> ErrorPower | None:
    """The power of tests of the step's error counts taken once on its whole sample with all of alpha (none kept
    for latency, none spent on earlier looks), exact over both sides' binomial counts. A sequential judge that
    spends alpha on looks and latency sits below `best`; None for latency scenarios."""
    if s.error_rate <= s.baseline_error_rate:
        return None
    n = s.canary_requests
    m = int(np.ceil(n * (1 - s.canary_share) / s.canary_share))
    largest = int(stats.binom.isf(1e-12, n, s.error_rate) + stats.binom.isf(1e-12, m, s.baseline_error_rate)) + 1
    best = fisher = 0.0
    for k in range(min(largest, n + m) + 1):
        null = stats.hypergeom(n + m, k, n)  # canary errors among k errors when both sides share one rate
        at_least = null.sf(np.arange(k + 2) - 1)  # P(X >= x), x = 0..k+1
        plain = np.where(at_least[: k + 1] <= alpha, 1.0, 0.0)
        coin = plain.copy()
        edge = int(np.argmax(at_least <= alpha))  # the smallest x rejected outright (k+1 when none)
        if edge > 0:  # at the last count not rejected, reject with the chance that makes the size exactly alpha
            coin[edge - 1] = (alpha - at_least[edge]) / null.pmf(edge - 1)
        x = np.arange(k + 1)
        joint = stats.binom.pmf(x, n, s.error_rate) * stats.binom.pmf(k - x, m, s.baseline_error_rate)
        best += float(np.sum(joint * coin))
        fisher += float(np.sum(joint * plain))
    return ErrorPower(best=best, fisher=fisher)


class StepRun(BaseModel):
    """One step of one run: what the judge (with the earlier steps' error counts), the same judge on the step's own
    counts, and the threshold gates decided within the step's canary requests."""

    judge: str = Field(description="fail, pass or inconclusive at the end of the step")
    judge_at: int = Field(description="canary requests when the judge decided (the step's length if it did not)")
    alone: str = Field(description="the judge without the earlier steps' counts (carry_errors off)")
    thresholds: str
    alpha_spent: float = Field(description="alpha the judge had spent over all metrics by its last look")
    counts: ErrorCounts = Field(description="both sides' error counts when the judge decided: what the next step carries")


def run_step(s: Scenario, share: float, config: JudgeConfig, rng: np.random.Generator,
             carried: list[ErrorCounts], look_every: int = 10, alone: bool = True) -> StepRun:
    """One canary step at `share`, judged every `look_every` canary requests, as a hold checks every second; its
    horizon is its length (the canary requests the hold sees: what rollout.py estimates from the arrival rate).
    `alone`: also judge it on its own counts (the ablation; "skipped" when off)."""
    n = s.canary_requests
    m = int(np.ceil(n * (1 - share) / share))
    canary = synthetic(rng, n, s.ttft_factor, s.error_rate, s.slow_share)
    baseline = synthetic(rng, m, 1.0, s.baseline_error_rate)
    judges = {"judge": SequentialJudge(config, horizon=n)}
    if alone:
        judges["alone"] = SequentialJudge(config.model_copy(update={"carry_errors": False}), horizon=n)
    result: dict = {} if alone else {"alone": "skipped"}
    for seen in range(look_every, n + 1, look_every):
        c, b = canary.head(seen), baseline.head(int(seen * (1 - share) / share))
        for name, judge in judges.items():
            if name in result:
                continue
            verdicts = judge.look(c, b, bounds=False, carried=carried)
            verdict = step_verdict(verdicts)
            if name == "judge":
                result.update(alpha_spent=sum(v.alpha_spent for v in verdicts), counts=ErrorCounts.of(c, b))
            if verdict != "inconclusive":
                result[name] = verdict
                result.setdefault("judge_at", seen) if name == "judge" else None
        if "thresholds" not in result and threshold_gates(c, b) == "fail":
            result["thresholds"] = "fail"
        if all(k in result for k in ("judge", "alone", "thresholds")):
            break
    for name, default in (("judge", "inconclusive"), ("alone", "inconclusive"), ("thresholds", "pass"),
                          ("judge_at", n), ("alpha_spent", 0.0)):
        result.setdefault(name, default)
    return StepRun(**result)


def run_plan(s: Scenario, shares: list[float], config: JudgeConfig, rng: np.random.Generator,
             alone: bool = True) -> list[StepRun]:
    """The plan's steps in order, each judged with the counts of every step before it (at that step's verdict),
    whatever that step decided: so each step's rate is its own power, or its own false rollbacks, given the
    evidence the plan hands it."""
    steps: list[StepRun] = []
    for share in shares:
        steps.append(run_step(s, share, config, rng, [r.counts for r in steps], alone=alone))
    return steps


class ScenarioRates(BaseModel):
    scenario: str
    share: float
    runs: int
    judge_fail: float = Field(description="share of runs this step rolled back, the earlier steps' counts carried")
    judge_pass: float
    reached: int = Field(description="runs whose earlier steps all passed: those that reach this step in a rollout")
    reached_fail: float = Field(description="of those, the share this step rolled back")
    by_step_fail: float = Field(description="share of runs rolled back at this step or an earlier one")
    alone_fail: float = Field(description="share of runs this step alone (its own counts) rolled back")
    judge_median_at: float = Field(description="median canary requests at the judge's verdict")
    alpha_spent: float = Field(description="mean alpha the judge had spent by its last look")
    thresholds_fail: float


def simulate(s: Scenario, shares: list[float], runs: int, seed: int, config: JudgeConfig | None = None,
             alone: bool = True) -> list[ScenarioRates]:
    """`runs` seeded rollouts through `shares`; the rates of each step (`alone`: with the ablation, twice the
    judging)."""
    config = config or JudgeConfig()
    rng = np.random.default_rng(seed)
    plans = [run_plan(s, shares, config, rng, alone) for _ in range(runs)]
    out = []
    for k, share in enumerate(shares):
        steps = [p[k] for p in plans]
        reached = [p[k] for p in plans if all(e.judge == "pass" for e in p[:k])]
        out.append(ScenarioRates(
            scenario=s.name, share=share, runs=runs,
            judge_fail=float(np.mean([r.judge == "fail" for r in steps])),
            judge_pass=float(np.mean([r.judge == "pass" for r in steps])),
            reached=len(reached),
            reached_fail=float(np.mean([r.judge == "fail" for r in reached])) if reached else float("nan"),
            by_step_fail=float(np.mean([any(e.judge == "fail" for e in p[: k + 1]) for p in plans])),
            alone_fail=float(np.mean([r.alone == "fail" for r in steps])) if steps[0].alone != "skipped" else math.nan,
            judge_median_at=float(np.median([r.judge_at for r in steps])),
            alpha_spent=float(np.mean([r.alpha_spent for r in steps])),
            thresholds_fail=float(np.mean([r.thresholds == "fail" for r in steps]))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--share", type=float, nargs="+", default=[0.05, 0.25, 0.5],
                    help="the plan's canary shares of the traffic, its steps in this order")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS), metavar="NAME")
    ap.add_argument("--judge", default="{}", help="JudgeConfig fields as JSON over the shipped defaults, e.g. "
                                                  "'{\"spending\": \"pocock\"}'")
    args = ap.parse_args()
    config = JudgeConfig.model_validate({**JudgeConfig().model_dump(), **json.loads(args.judge)})
    rows = []
    for i, name in enumerate(args.scenarios):
        t0 = time.perf_counter()
        rates = simulate(SCENARIOS[name], args.share, args.runs, args.seed + i, config)
        took = time.perf_counter() - t0
        for r in rates:
            s = SCENARIOS[name].model_copy(update={"canary_share": r.share})
            power = error_power(s, config.alpha)
            rows.append([f"{s.name} @ {r.share:.0%}", f"{s.canary_requests}", f"{100 * r.judge_fail:.1f} %",
                         f"{100 * r.reached_fail:.1f} % of {r.reached}", f"{100 * r.by_step_fail:.1f} %",
                         f"{100 * r.alone_fail:.1f} %", f"{r.judge_median_at:.0f}", f"{r.alpha_spent:.3f}",
                         f"{100 * r.thresholds_fail:.1f} %",
                         "-" if power is None else f"{100 * power.best:.1f} / {100 * power.fisher:.1f} %",
                         TARGETS.get(name, "-"), f"{took:.0f}s"])
    print(f"{args.runs} seeded rollouts per scenario through the steps {', '.join(f'{x:.0%}' for x in args.share)}; "
          f"rolled back = the step failed within the canary requests shown; judge: alpha {config.alpha} "
          f"({config.error_alpha_share:g} of it to errors), {config.spending} spending over the step's canary requests, "
          f"errors carried from step to step: {config.carry_errors}")
    print_table(["scenario @ step", "canary requests", "judge: rolled back", "reached the step: rolled back",
                 "rolled back by the step", "the step alone", "judge: median requests to verdict",
                 "judge: alpha spent", "threshold gates: rolled back", "error tests of the step alone: best / Fisher",
                 "wanted", "time"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
