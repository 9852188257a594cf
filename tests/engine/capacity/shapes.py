"""A made-up role profile whose figures are known in closed form: what the planner's tests plan from."""

from __future__ import annotations

from datetime import datetime, timezone

from engine.capacity.plan import SLO, PlanSpec
from engine.capacity.profile import DecodePoint, MemoryFigures, PrefillPoint, RoleProfile


def shape(alone_s: float = 0.1, tok_s: float = 2560.0) -> RoleProfile:
    """A shape whose 256-token prompt takes `alone_s` alone and whose members take `tok_s` prompt tokens a second
    at their best batch; decode ITL p90 grows with the sequences a member holds."""
    prefill = [PrefillPoint(input_len=n, batch=b, ttft_s=alone_s * n / 256 * (b if b > 1 else 1),
                            tokens_per_s=tok_s if b > 1 else n / (alone_s * n / 256)) for n in (64, 256, 1024) for b in (1, 4)]
    decode = [DecodePoint(concurrency=c, context=ctx, itl_s=0.01 + 0.001 * c, itl_p90_s=0.012 + 0.001 * c * (ctx / 512),
                          tokens_per_s=c / (0.01 + 0.001 * c)) for ctx in (128, 1024) for c in (1, 8, 32)]
    return RoleProfile(model="m", model_dir="/m", host="test shape", device="cpu", dtype="float32", threads=2,
                       created_at=datetime(2026, 1, 1, tzinfo=timezone.utc), prefill=prefill, decode=decode,
                       memory=MemoryFigures(kv_bytes_per_token=16384, weights_bytes=4 * 10**8, buffers_bytes=10**6,
                                            kv_budget_bytes=16384 * 65536, kv_tokens=65536))


SPEC = PlanSpec(slo=SLO(ttft_p90_s=0.5, itl_p90_s=0.04), input_tokens=256, output_tokens=128)
