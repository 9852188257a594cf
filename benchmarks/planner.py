"""The capacity plan backtested: a compressed tidal day with an unforecast burst, replayed against real groups
under three policies, each interval judged against the SLA, each policy's member-hours counted.

    python benchmarks/planner.py [--day-s 240] [--peak-rps 6] [--spike-at 14] [--slo-ttft-ms 1500]
                                 [--slo-tpot-ms 150] [--max-num-seqs 4]

One tiny-model colocated group = one member (`--max-num-seqs` batch slots: what one group carries). The shape is
profiled first (`engine.capacity.profile`), then planned (`engine.capacity.plan`) against the day's tide as the
forecast: the burst (`--spike-factor` x the rate for 5 % of the day, from `--spike-at`) is not in it, as no
forecast knows a burst. Policies, each replaying the same trace (harness.tidal_replay) on fresh groups:
  static    the plan's peak groups all day, no autoscaler decisions (peak provisioning)
  reactive  today's autoscaler: queue watermarks, one group at least, a warm pool of 1
  plan      the plan's hourly groups as schedule and floors, its warm pool, the same watermarks on top
An interval is a virtual hour with requests; it meets the SLA when none failed and its TTFT p90 and TPOT p90 are
within the targets. Member-hours: serving and warm standby groups, sampled every 0.25 s, in virtual hours. Targets
(issue #43): the plan meets the SLA in >= 99 % of intervals, with <= 0.7x the static policy's member-hours and
fewer misses than reactive.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host, print_table  # noqa: E402

from engine.capacity.apply import policy_from_plan  # noqa: E402
from engine.capacity.forecast import Forecast  # noqa: E402
from engine.capacity.plan import SLO, PlanSpec, plan  # noqa: E402
from engine.capacity.profile import ProfileSpec, profile_role  # noqa: E402
from engine.offline.default_model import TINY_CONFIG, write_default_model  # noqa: E402
from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.group.spec import InferenceGroup  # noqa: E402
from engine.scaling.policy import Bounds, MetricPolicy, Schedule, ScheduleEntry, ScalingPolicy  # noqa: E402
from engine.model.tokenizer import Tokenizer  # noqa: E402
from harness.tidal_replay import TidalReport, replay_day  # noqa: E402
from harness.tide import DAY_S, TidalDay  # noqa: E402

KV_BYTES = 32 * 2**20


def template(model_dir: Path, name: str, max_num_seqs: int) -> InferenceGroup:
    return InferenceGroup.model_validate({
        "name": name, "version": "v1", "model": {"path": str(model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": KV_BYTES, "max_num_seqs": max_num_seqs}}]})


def meets(interval, args) -> bool:
    return (not interval.errors and interval.ttft_p90_ms is not None and interval.ttft_p90_ms <= args.slo_ttft_ms
            and (interval.tpot_p90_ms is None or interval.tpot_p90_ms <= args.slo_tpot_ms))


def judged(report: TidalReport, args) -> tuple[int, list[str], float]:
    """(intervals with requests, the hours that missed the SLA, member-hours: 1 member a group)."""
    busy = [i for i in report.intervals if i.sent]
    return (len(busy), [f"{i.hour:02d}" for i in busy if not meets(i, args)],
            sum(i.serving_mean + i.standby_mean for i in report.intervals))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--day-s", type=float, default=240.0, help="real seconds per virtual day")
    ap.add_argument("--peak-rps", type=float, default=6.0)
    ap.add_argument("--spike-at", type=float, default=14.0, help="virtual hour the burst begins")
    ap.add_argument("--spike-factor", type=float, default=3.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0)
    ap.add_argument("--max-num-seqs", type=int, default=4, help="batch slots per group: what one group carries")
    ap.add_argument("--cold-start-s", type=float, default=8.0, help="real seconds a group takes to start")
    ap.add_argument("--policies", nargs="+", default=["static", "reactive", "plan"], choices=["static", "reactive", "plan"])
    args = ap.parse_args()
    day = TidalDay(day_s=args.day_s, peak_rps=args.peak_rps, night_rps=args.peak_rps / 10, spike_start_h=args.spike_at,
                   spike_factor=args.spike_factor)
    metrics = MetricPolicy(queue_high=2, queue_low=0.5, calm_ticks=3, cooldown_up_s=2, cooldown_down_s=args.day_s / 12)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="tideflow-planner-") as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        model_dir = write_default_model(Path(tmp) / "model", TINY_CONFIG, seed=0)
        trace = Path(tmp) / "day.jsonl"
        sent = day.write_trace(trace)
        tok = Tokenizer(model_dir)
        input_tokens = round(statistics.mean(len(tok.encode(json.loads(line)["prompt"]))
                                             for line in trace.read_text().splitlines()))
        profile = profile_role(ProfileSpec(
            model_dir=model_dir, kv_cache_bytes=KV_BYTES, max_num_seqs=args.max_num_seqs,
            input_lens=[max(8, input_tokens // 2), input_tokens, 2 * input_tokens], prefill_batches=[1, args.max_num_seqs],
            concurrency=sorted({1, 2, args.max_num_seqs}), contexts=[input_tokens, input_tokens + day.max_tokens],
            decode_tokens=day.max_tokens), progress=lambda m: print(f"profile: {m}", file=sys.stderr, flush=True))
        forecast = Forecast(hourly_rps=[round(day.tide(h + 0.5), 4) for h in range(24)], source="the day's tide")
        spec = PlanSpec(slo=SLO(ttft_p90_s=args.slo_ttft_ms / 1000, itl_p90_s=args.slo_tpot_ms / 1000),
                        input_tokens=input_tokens, output_tokens=day.max_tokens,
                        cold_start_s=args.cold_start_s * DAY_S / args.day_s)  # a start, in the day's own seconds
        planned = plan(spec, forecast, profile)
        base = template(model_dir, "base", args.max_num_seqs)
        from_plan = policy_from_plan(planned, base, ScalingPolicy(metrics=metrics, tick_s=0.5))
        peak = max(e.groups for e in from_plan.schedule.entries)
        policies = {
            "static": ScalingPolicy(bounds=Bounds(min_groups=peak, max_groups=peak), warm_pool=0, tick_s=0.5,
                                    schedule=Schedule(entries=[ScheduleEntry(at="00:00", groups=peak)])),
            "reactive": ScalingPolicy(bounds=Bounds(min_groups=1, max_groups=max(peak + 1, 2)), warm_pool=1,
                                      metrics=metrics, tick_s=0.5),
            "plan": from_plan.model_copy(update={"bounds": Bounds(min_groups=from_plan.bounds.min_groups,
                                                                  max_groups=max(peak + 1, 2))}),
        }
        notes.append(f"plan: {', '.join(f'{e.at:%H}h {e.groups}' for e in from_plan.schedule.entries)} groups, warm pool "
                     f"{from_plan.warm_pool}; peak {peak} (static)")
        with LocalGroupSet(GroupSetConfig(model_dir=model_dir, model_name="default")) as gs:
            for name in args.policies:
                print(f"replaying the day under {name}", file=sys.stderr, flush=True)
                report = replay_day(gs, template(model_dir, f"day-{name}", args.max_num_seqs), policies[name], day, trace)
                busy, missed, hours = judged(report, args)
                rows.append([name, f"{100 * (busy - len(missed)) / busy:.1f} %" if busy else "-", len(missed),
                             ", ".join(missed) or "-",
                             f"{hours:.1f}", report.errors, report.cold_starts, len(report.activations_s)])
    static_hours = next((float(r[4]) for r in rows if r[0] == "static"), None)
    for r in rows:
        r.insert(5, f"{float(r[4]) / static_hours:.2f}x" if static_hours else "-")
    print(f"\n{host()}; tiny model, a {args.day_s:g} s day of {sent} requests (peak {args.peak_rps:g} req/s, a "
          f"{args.spike_factor:g}x burst from {args.spike_at:g}h for 1.2 h), SLA: TTFT p90 <= {args.slo_ttft_ms:g} ms, "
          f"TPOT p90 <= {args.slo_tpot_ms:g} ms, no error; {input_tokens} prompt tokens on average")
    for n in notes:
        print(n)
    print_table(["policy", "intervals meeting the SLA", "misses", "missed hours", "member-hours", "vs static",
                 "errors", "cold starts", "activations"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
