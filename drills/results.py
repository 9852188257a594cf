"""What a load drill observed: one record per request, a summary per step, the capacity watermark."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field

from drills.spec import LoadDrillSpec


class RequestRecord(BaseModel):
    """One request, sent or dropped; times are seconds from drill start, latencies milliseconds."""

    step: int = Field(ge=0, description="step index the request was scheduled in")
    index: int = Field(ge=0, description="position in the whole schedule")
    scheduled_s: float = Field(description="when the schedule wanted it sent")
    sent_s: float = Field(description="when it was actually sent (or dropped)")
    end_s: float = Field(description="when its stream ended or it failed")
    ok: bool = Field(description="finished with at least one token and no error")
    error: str | None = Field(None, description="why it failed; None when ok")
    prompt_tokens: int = Field(ge=0, description="server's usage count when reported, else the planned length")
    output_tokens: int = Field(ge=0, description="server's usage count when reported, else chunks with text")
    max_tokens: int = Field(ge=1, description="tokens asked for")
    ttft_ms: float | None = Field(None, description="send to first text chunk")
    tpot_ms: float | None = Field(None, description="(end-to-end - TTFT) / (output tokens - 1)")
    itl_ms: float | None = Field(None, description="mean gap between text chunks")
    e2e_ms: float | None = Field(None, description="send to end of stream")
    max_gap_ms: float | None = Field(None, description="longest pause between two text chunks of the stream")
    itl_gaps_ms: list[float] = Field(default_factory=list, exclude=True, description="every gap between text chunks")
    prompt: str = Field("", exclude=True, description="what was asked (a fault drill replays it)")
    chunks: list[str] = Field(default_factory=list, exclude=True, description="the text chunks, in order")

    def meets_slo(self, spec: LoadDrillSpec) -> bool:
        if not self.ok:
            return False
        if spec.slo_ttft_ms is not None and (self.ttft_ms is None or self.ttft_ms > spec.slo_ttft_ms):
            return False
        return spec.slo_tpot_ms is None or self.tpot_ms is None or self.tpot_ms <= spec.slo_tpot_ms


class StepSummary(BaseModel):
    """One step's latency quantiles (ms), throughput and accounting; a row of the step table."""

    step: int = Field(ge=0)
    offered_rate: float = Field(gt=0, description="requests/s the schedule offered")
    sent: int = Field(ge=0, description="requests the schedule put in this step (each must end ok or error)")
    ok: int = Field(ge=0)
    error: int = Field(ge=0)
    error_rate: float = Field(ge=0, le=1)
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None
    tpot_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p99: float | None = None
    output_tokens: int = Field(ge=0, description="tokens streamed back by ok requests")
    window_s: float = Field(ge=0, description="first send to last end among this step's requests")
    output_tok_s: float = Field(ge=0, description="output_tokens / window_s")
    req_s: float = Field(ge=0, description="ok requests / window_s")
    goodput_req_s: float = Field(ge=0, description="ok requests meeting every SLO / window_s")
    schedule_lag_p99_ms: float | None = Field(None, description="how late sends were against the schedule")
    slo_held: bool = Field(description="quantile TTFT and TPOT within SLO and error rate at most the limit")
    error_reasons: dict[str, int] = Field(default_factory=dict, description="failure reason -> count")


class ExpectationOutcome(BaseModel):
    """Result of the Great Expectations suite over the step table."""

    suite: str
    success: bool
    failed: list[str] = Field(default_factory=list, description="expectation type and kwargs of each failure")


class LoadDrillReport(BaseModel):
    """Everything a load drill found; `requests` is kept in memory and written as CSV, not into the JSON."""

    spec: LoadDrillSpec
    started_at: str = Field(description="UTC ISO time the first request was due")
    steps: list[StepSummary]
    capacity_rps: float | None = Field(None, description="highest offered rate reached with every step up to it holding")
    capacity_step: int | None = None
    sent: int = Field(ge=0, description="requests issued, counted before each left (not derived from results)")
    ok: int = Field(ge=0)
    error: int = Field(ge=0)
    still_open: int = Field(0, ge=0, description="issued requests with no result when the drill ended")
    expectations: ExpectationOutcome | None = None
    files: dict[str, str] = Field(default_factory=dict, description="report kind -> path written")
    requests: list[RequestRecord] = Field(default_factory=list, exclude=True)

    @property
    def lost(self) -> int:
        """Issued requests that ended with neither a result nor an error: must be 0."""
        return self.sent - self.ok - self.error - self.still_open

    @property
    def accounted(self) -> bool:
        return self.lost == 0 and self.still_open == 0

    def step_frame(self) -> pd.DataFrame:
        """The step table (one row per step), as written to steps.csv and validated by the GX suite."""
        return pd.DataFrame([s.model_dump(exclude={"error_reasons"}) for s in self.steps])

    def request_frame(self) -> pd.DataFrame:
        return pd.DataFrame([r.model_dump() for r in self.requests])


def _q(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize_step(step: int, rate: float, planned: int, records: list[RequestRecord],
                   spec: LoadDrillSpec) -> StepSummary:
    """`planned` counts the schedule's requests, `records` what came back: the table checks they agree."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    itl = [g for r in ok for g in r.itl_gaps_ms]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    window = max((r.end_s for r in records), default=0.0) - min((r.sent_s for r in records), default=0.0)
    per_s = (lambda n: n / window) if window > 0 else (lambda n: 0.0)
    tokens = sum(r.output_tokens for r in ok)
    n_err = sum(not r.ok for r in records)
    error_rate = min(n_err / planned, 1.0) if planned else 0.0
    q = spec.slo_quantile * 100
    held = planned > 0 and len(records) == planned and error_rate <= spec.max_error_rate
    if spec.slo_ttft_ms is not None:
        held = held and bool(ttft) and _q(ttft, q) <= spec.slo_ttft_ms
    if spec.slo_tpot_ms is not None and tpot:
        held = held and _q(tpot, q) <= spec.slo_tpot_ms
    return StepSummary(
        step=step, offered_rate=rate, sent=planned, ok=len(ok), error=n_err, error_rate=error_rate,
        ttft_p50=_q(ttft, 50), ttft_p90=_q(ttft, 90), ttft_p99=_q(ttft, 99),
        tpot_p50=_q(tpot, 50), tpot_p90=_q(tpot, 90), tpot_p99=_q(tpot, 99),
        itl_p50=_q(itl, 50), itl_p99=_q(itl, 99), e2e_p50=_q(e2e, 50), e2e_p99=_q(e2e, 99),
        output_tokens=tokens, window_s=max(window, 0.0), output_tok_s=per_s(tokens), req_s=per_s(len(ok)),
        goodput_req_s=per_s(sum(r.meets_slo(spec) for r in ok)),
        schedule_lag_p99_ms=_q([(r.sent_s - r.scheduled_s) * 1000 for r in records], 99),
        slo_held=held, error_reasons=dict(Counter(r.error for r in records if r.error is not None)),
    )


def capacity_watermark(steps: list[StepSummary]) -> StepSummary | None:
    """The highest step of the unbroken run of holding steps from the bottom: a pass above a failure is luck, not capacity."""
    best = None
    for s in sorted(steps, key=lambda s: s.offered_rate):
        if not s.slo_held:
            break
        best = s
    return best
