"""`tideflow plan`: how many prefill and decode members each hour of the forecast day needs to meet TTFT and ITL
targets, from measured role profiles, with queueing counted, the warm pool ahead of each ramp, and a reason on
every number.

Why queueing: a plan from throughput alone provisions exactly the mean load and misses the target whenever
arrivals bunch (the burst a throughput planner ignores). Prefill is modelled as M/M/c: c members, each taking
prompts at the rate its profile measured at the workload's input length (its best batch), a prompt's own time
its batch-1 TTFT, the wait's tail from Erlang C: P(wait > t) = C(c, a) exp(-(c mu - lambda) t). Decode is a
closed loop: by Little's law lambda x output tokens x ITL sequences decode at once; spread over d members each
holds n of them (from the profile's median ITL), and its ITL p90 at n sequences (interpolated between the
concurrencies and contexts it measured, never past its largest concurrency) must meet the target with n x (input + output) tokens within its KV
budget. Headroom is added to every rate first. The warm pool before an hour holds the members its ramp adds
(started `cold_start_s` ahead, they are loaded and silent when it begins), so a ramp never waits on a cold start.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engine.capacity.forecast import Forecast
from engine.capacity.profile import RoleProfile

WAIT_QUANTILE = 0.9  # the targets are p90s


class SLO(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_p90_s: float = Field(gt=0, description="time to first token, p90 of each hour")
    itl_p90_s: float = Field(gt=0, description="inter-token latency, p90 of each hour")


class PlanSpec(BaseModel):
    """What the plan must meet and with what margins."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slo: SLO
    input_tokens: int = Field(gt=0, description="prompt tokens of a typical request (the mean)")
    output_tokens: int = Field(gt=0, description="tokens generated for a typical request (the mean)")
    headroom: float = Field(0.15, ge=0, le=2, description="provision for this much more than the forecast rate")
    cold_start_s: float = Field(120.0, ge=0, description="a member's start to Ready (the drills' rebuild time): how "
                                                         "early a ramp's members start, into the warm pool")
    member_memory_bytes: int | None = Field(None, gt=0, description="memory one member may hold: its weights and "
                                                                    "KV budget must fit (None: not checked)")
    max_members: int = Field(512, ge=1, description="a role needing more than this for an hour is refused")
    ttft_correction: float = Field(1.0, gt=0, le=10, description="measured / predicted TTFT of a served member at a "
                                                                 "low load (benchmarks/plan_check.py): a prompt's own "
                                                                 "time is taken as this much longer than profiled (the "
                                                                 "HTTP path, decode steps in between), its member's "
                                                                 "prompt rate as profiled")
    itl_correction: float = Field(1.0, gt=0, le=10, description="measured / predicted ITL of a served member: a member "
                                                                "is taken to decode this much slower than its profile")


class RolePlan(BaseModel):
    members: int
    predicted_p90_s: float = Field(description="TTFT p90 (prefill) or ITL p90 (decode) at that count")
    reason: str


class HourPlan(BaseModel):
    hour: int
    rps: float = Field(description="the forecast rate")
    planned_rps: float = Field(description="the rate provisioned for: the forecast plus headroom")
    prefill: RolePlan
    decode: RolePlan
    members: int
    warm_pool: int = Field(description="members started ahead and kept silent in this hour, for the next ramp")
    warm_reason: str


class CapacityPlan(BaseModel):
    spec: PlanSpec
    forecast: Forecast
    prefill_host: str
    decode_host: str
    hours: list[HourPlan]
    peak_members: int
    member_hours: int = Field(description="members summed over the day's hours, each hour's warm pool counted for the "
                                          "whole hour (the autoscaler keeps its standby groups loaded, not just for "
                                          "cold_start_s)")


class PlanRefused(ValueError):
    """The targets cannot be met by these shapes (or do not fit their memory): nothing to apply."""


def erlang_c(servers: int, load: float) -> float:
    """Probability that an arrival waits in M/M/c with `servers` and offered `load` (lambda / mu) < servers."""
    b = 1.0  # Erlang B by its recursion: stable for any size
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return servers * b / (servers - load * (1 - b))


class PrefillPrediction(BaseModel):
    ttft_p90_s: float
    alone_s: float = Field(description="a prompt's own time (batch-1 TTFT)")
    queue_p90_s: float = Field(description="the wait's p90")
    waiting: float = Field(description="share of prompts that wait (Erlang C)")
    member_rps: float = Field(description="prompts a second one member takes")


class DecodePrediction(BaseModel):
    itl_p90_s: float
    per_member: float = Field(description="sequences a member decodes at once")
    kv_tokens: float = Field(description="KV tokens those sequences hold on a member")


def predict_prefill(rate: float, profile: RoleProfile, spec: PlanSpec, members: int) -> PrefillPrediction | None:
    """TTFT p90 of `members` prefill members at `rate` prompts a second; None when they cannot keep up."""
    alone, mu = _prefill_rates(profile, spec.input_tokens)
    alone *= spec.ttft_correction  # served, a prompt's own time is longer than profiled; the member's rate is not
    if rate >= members * mu:
        return None
    waits = erlang_c(members, rate / mu)
    tail = (math.log(waits / (1 - WAIT_QUANTILE)) / (members * mu - rate)) if waits > 1 - WAIT_QUANTILE else 0.0
    return PrefillPrediction(ttft_p90_s=alone + tail, alone_s=alone, queue_p90_s=tail, waiting=waits, member_rps=mu)


def predict_decode(rate: float, profile: RoleProfile, spec: PlanSpec, members: int) -> DecodePrediction | None:
    """ITL p90 of `members` decode members at `rate` requests a second; None when their share runs past what the
    profile measured (more sequences than its largest concurrency), past their KV budget, or never settles (they
    cannot keep up). The sequences in flight follow from the median ITL (Little's law needs the typical pace); the
    target is checked on the p90."""
    context = spec.input_tokens + spec.output_tokens / 2  # the mean context over a decode
    typical = [(n, itl * spec.itl_correction) for n, itl in _decode_curve(profile, context, "itl_s")]
    tail = [(n, itl * spec.itl_correction) for n, itl in _decode_curve(profile, context, "itl_p90_s")]
    n = _in_flight(rate, spec.output_tokens, typical, members)
    if n is None:
        return None
    kv = max(n, 1.0) * (spec.input_tokens + spec.output_tokens)  # one sequence at least: it must fit whole
    if kv > profile.memory.kv_tokens:
        return None
    return DecodePrediction(itl_p90_s=_interp(tail, n), per_member=n, kv_tokens=kv)


def prefill_members(rate: float, profile: RoleProfile, spec: PlanSpec) -> RolePlan:
    alone = _prefill_rates(profile, spec.input_tokens)[0] * spec.ttft_correction
    if alone > spec.slo.ttft_p90_s:
        raise PlanRefused(f"one {spec.input_tokens}-token prompt alone takes {alone * 1e3:.0f} ms to its first token on "
                          f"this prefill shape ({profile.host}): above the TTFT target {spec.slo.ttft_p90_s * 1e3:.0f} ms")
    for c in range(1, spec.max_members + 1):
        p = predict_prefill(rate, profile, spec, c)
        if p is not None and p.ttft_p90_s <= spec.slo.ttft_p90_s:
            return RolePlan(members=c, predicted_p90_s=p.ttft_p90_s, reason=(
                f"{rate:.2f} req/s of {spec.input_tokens}-token prompts, {p.member_rps:.2f} req/s a member: {c} keep "
                f"TTFT p90 at {p.ttft_p90_s * 1e3:.0f} ms ({p.alone_s * 1e3:.0f} ms alone + {p.queue_p90_s * 1e3:.0f} "
                f"ms of queue, {100 * p.waiting:.0f} % of prompts wait) within {spec.slo.ttft_p90_s * 1e3:.0f} ms"
                + ("" if c == 1 else f"; {c - 1} would not")))
    raise PlanRefused(f"prefill needs more than {spec.max_members} members for {rate:.2f} req/s")


def decode_members(rate: float, profile: RoleProfile, spec: PlanSpec) -> RolePlan:
    for d in range(1, spec.max_members + 1):
        p = predict_decode(rate, profile, spec, d)
        if p is not None and p.itl_p90_s <= spec.slo.itl_p90_s:
            return RolePlan(members=d, predicted_p90_s=p.itl_p90_s, reason=(
                f"{rate:.2f} req/s x {spec.output_tokens} tokens: {p.per_member * d:.1f} sequences decode at once, "
                f"{p.per_member:.1f} a member at ITL p90 {p.itl_p90_s * 1e3:.1f} ms within "
                f"{spec.slo.itl_p90_s * 1e3:.1f} ms, {p.kv_tokens:.0f} of {profile.memory.kv_tokens} KV tokens"
                + ("" if d == 1 else f"; {d - 1} would not")))
    alone = _decode_curve(profile, spec.input_tokens + spec.output_tokens / 2, "itl_p90_s")[0][1] * spec.itl_correction
    if alone > spec.slo.itl_p90_s:
        raise PlanRefused(f"ITL p90 is {alone * 1e3:.1f} ms with one sequence on this decode shape "
                          f"({profile.host}): above the target {spec.slo.itl_p90_s * 1e3:.1f} ms")
    raise PlanRefused(f"decode needs more than {spec.max_members} members for {rate:.2f} req/s")


def check_fit(profile: RoleProfile, spec: PlanSpec, role: str) -> None:
    """Weights plus the KV budget within a member's memory, else refused with the numbers."""
    if spec.member_memory_bytes is None:
        return
    m = profile.memory
    need = m.weights_bytes + m.buffers_bytes + m.kv_budget_bytes
    if need > spec.member_memory_bytes:
        raise PlanRefused(f"a {role} member needs {need / 1e9:.2f} GB (weights {m.weights_bytes / 1e9:.2f} GB + "
                          f"buffers {m.buffers_bytes / 1e9:.2f} GB + KV {m.kv_budget_bytes / 1e9:.2f} GB for "
                          f"{m.kv_tokens} tokens), "
                          f"{(need - spec.member_memory_bytes) / 1e9:.2f} GB more than its {spec.member_memory_bytes / 1e9:.2f} GB")


def plan(spec: PlanSpec, forecast: Forecast, prefill: RoleProfile, decode: RoleProfile | None = None) -> CapacityPlan:
    """The same inputs give the same plan: nothing here is random or timed."""
    decode = decode or prefill
    check_fit(prefill, spec, "prefill")
    check_fit(decode, spec, "decode")
    hours = []
    for hour, rps in enumerate(forecast.hourly_rps):
        planned = rps * (1 + spec.headroom)
        p = prefill_members(planned, prefill, spec) if planned > 0 else _idle("prefill")
        d = decode_members(planned, decode, spec) if planned > 0 else _idle("decode")
        hours.append(HourPlan(hour=hour, rps=rps, planned_rps=planned, prefill=p, decode=d,
                              members=p.members + d.members, warm_pool=0, warm_reason=""))
    ahead = max(1, math.ceil(spec.cold_start_s / 3600))  # hours a start can take: look that far for ramps
    for h in hours:
        later = [hours[(h.hour + k) % 24] for k in range(1, ahead + 1)]
        peak_next = max(later, key=lambda x: x.members)
        h.warm_pool = max(0, peak_next.members - h.members)
        h.warm_reason = (f"hour {peak_next.hour} needs {peak_next.members} members, {h.warm_pool} more: started "
                         f"{spec.cold_start_s:g} s ahead, silent until it begins" if h.warm_pool else "no ramp ahead")
    return CapacityPlan(spec=spec, forecast=forecast, prefill_host=prefill.host, decode_host=decode.host, hours=hours,
                        peak_members=max(h.members for h in hours),
                        member_hours=sum(h.members + h.warm_pool for h in hours))


def _idle(role: str) -> RolePlan:
    return RolePlan(members=1, predicted_p90_s=0.0, reason=f"no traffic forecast: one {role} member stays up")


def _prefill_rates(profile: RoleProfile, tokens: int) -> tuple[float, float]:
    """(seconds a prompt of `tokens` takes alone, prompts a second one member takes at its best batch), each
    interpolated in prompt length between the lengths measured; refused beyond them."""
    alone = sorted((p.input_len, p.ttft_s) for p in profile.prefill if p.batch == 1 and p.ttft_s)
    best: dict[int, float] = {}
    for p in profile.prefill:
        if p.tokens_per_s:
            best[p.input_len] = max(best.get(p.input_len, 0.0), p.tokens_per_s)
    if not alone or not best:
        raise PlanRefused("the prefill profile has no measured batch-1 point: profile with --prefill-batches 1")
    lengths = [x for x, _ in alone]
    if not lengths[0] <= tokens <= lengths[-1]:
        raise PlanRefused(f"prompts of {tokens} tokens lie outside the lengths the prefill profile measured "
                          f"({lengths[0]}-{lengths[-1]}): profile with --input-lens covering them")
    rate = _interp(sorted(best.items()), tokens)
    return _interp(alone, tokens), rate / tokens


def _decode_curve(profile: RoleProfile, context: float, figure: str) -> list[tuple[float, float]]:
    """`figure` (itl_s or itl_p90_s) against sequences a member decodes, at `context` tokens: interpolated between
    the two nearest contexts measured (a profile of one context stands for every context); within the
    concurrencies measured (below the smallest, its figure; past the largest, the callers refuse)."""
    by_context: dict[int, list[tuple[float, float]]] = {}
    for d in profile.decode:
        if getattr(d, figure):
            by_context.setdefault(d.context, []).append((float(d.concurrency), getattr(d, figure)))
    contexts = sorted(by_context)
    if not contexts:
        raise PlanRefused("the decode profile has no measured point")
    if not contexts[0] <= context <= contexts[-1] and len(contexts) > 1:
        raise PlanRefused(f"a mean context of {context:.0f} tokens lies outside the contexts the decode profile "
                          f"measured ({contexts[0]}-{contexts[-1]}): profile with --contexts covering it")
    below = max((c for c in contexts if c <= context), default=contexts[0])
    above = min((c for c in contexts if c >= context), default=contexts[-1])
    lo, hi = sorted(by_context[below]), sorted(by_context[above])
    shared = sorted({n for n, _ in lo} & {n for n, _ in hi})
    if not shared:
        raise PlanRefused(f"contexts {below} and {above} share no measured concurrency")
    w = 0.0 if above == below else (context - below) / (above - below)
    return [(n, (1 - w) * _interp(lo, n) + w * _interp(hi, n)) for n in shared]


def _in_flight(rate: float, tokens: int, curve: list[tuple[float, float]], members: int) -> float | None:
    """Sequences a member holds at `rate`: the fixed point of n = rate x tokens x ITL(n) / members; None when it
    runs past the curve or does not settle (the members cannot keep up within what was measured)."""
    n = rate * tokens * curve[0][1] / members
    for _ in range(200):
        if n > curve[-1][0]:
            return None
        following = rate * tokens * _interp(curve, n) / members
        if abs(following - n) < 1e-6:
            return following if following <= curve[-1][0] else None
        n = following
    return None


def _interp(points: list[tuple[float, float]], x: float) -> float:
    xs, ys = zip(*points)
    return float(np.interp(x, xs, ys))


def as_table(p: CapacityPlan) -> str:
    """The plan hour by hour (markdown), then each role's reason at the peak."""
    lines = [f"plan for {p.forecast.source} ({p.forecast.timezone}), TTFT p90 <= {p.spec.slo.ttft_p90_s * 1e3:g} ms, "
             f"ITL p90 <= {p.spec.slo.itl_p90_s * 1e3:g} ms, {p.spec.input_tokens} in / {p.spec.output_tokens} out, "
             f"headroom {100 * p.spec.headroom:g} %, corrections TTFT x{p.spec.ttft_correction:g} ITL "
             f"x{p.spec.itl_correction:g}", "",
             "| hour | req/s | planned | prefill | decode | P:D | TTFT p90 ms | ITL p90 ms | warm pool |",
             "|---|---|---|---|---|---|---|---|---|"]
    for h in p.hours:
        lines.append(f"| {h.hour:02d} | {h.rps:g} | {h.planned_rps:.2f} | {h.prefill.members} | {h.decode.members} | "
                     f"{h.prefill.members}:{h.decode.members} | {h.prefill.predicted_p90_s * 1e3:.0f} | "
                     f"{h.decode.predicted_p90_s * 1e3:.1f} | {h.warm_pool} |")
    peak = max(p.hours, key=lambda h: h.members)
    lines += ["", f"peak {p.peak_members} members at hour {peak.hour:02d}; {p.member_hours} member-hours a day",
              f"prefill at the peak: {peak.prefill.reason}", f"decode at the peak: {peak.decode.reason}"]
    return "\n".join(lines)
