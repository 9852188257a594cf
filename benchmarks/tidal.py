"""A tidal day compressed into minutes, replayed twice in one run: warm pool on vs off.

Night is low, the morning ramp climbs to the peak, the evening falls. The autoscaler follows the
schedule (one group at night, more for the ramp and the peak) and the queue. With the pool on,
the ramp's extra groups are activated from standby in well under a second; with it off they are
cold-started while requests queue. Prints, per phase: serving groups, TTFT p99, errors.

    python benchmarks/tidal.py                 # tiny model, a 120 s day
    python benchmarks/tidal.py --day-s 240 --default-model
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model  # noqa: E402
from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.group.spec import InferenceGroup  # noqa: E402
from engine.scaling.policy import Bounds, MetricPolicy, ScalingPolicy  # noqa: E402
from harness.tidal_replay import replay_day  # noqa: E402
from harness.tide import TidalDay  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--day-s", type=float, default=120.0, help="real seconds per virtual day")
    ap.add_argument("--peak-rps", type=float, default=6.0)
    ap.add_argument("--default-model", action="store_true", help="the default model instead of the tiny one")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="batch slots per group: what one group can carry")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    args = ap.parse_args()

    day = TidalDay(day_s=args.day_s, peak_rps=args.peak_rps, night_rps=args.peak_rps / 10)
    metrics = MetricPolicy(queue_high=2, queue_low=0.5, calm_ticks=3, cooldown_up_s=2, cooldown_down_s=args.day_s / 12)
    schedule = day.schedule(night=1, ramp=2, peak=3, fall=2, night_floor=1)
    rows, reports = [], []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        model_dir = write_default_model(Path(tmp) / "model", DEFAULT_CONFIG if args.default_model else TINY_CONFIG, seed=0)
        trace = Path(tmp) / "tidal.jsonl"
        n = day.write_trace(trace)
        print(f"trace: {n} requests over a {args.day_s:g} s day", file=sys.stderr)
        with LocalGroupSet(GroupSetConfig(model_dir=model_dir, model_name="default")) as gs:
            for pool_size, name in ((2, "tide-on"), (0, "tide-off")):
                template = InferenceGroup.model_validate({
                    "name": name, "version": "v1", "model": {"path": str(model_dir)},
                    "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 32 * 2**20,
                                                                "max_num_seqs": args.max_num_seqs}}]})
                policy = ScalingPolicy(bounds=Bounds(min_groups=1, max_groups=3), warm_pool=pool_size,
                                       metrics=metrics, schedule=schedule, tick_s=0.5)
                report = replay_day(gs, template, policy, day, trace)
                reports.append(report)
                for p in report.phases:
                    rows.append([f"pool {'on' if pool_size else 'off'}", p.phase, p.sent, f"{p.groups_mean:.1f}",
                                 p.groups_max, "-" if p.ttft_p99_ms is None else f"{p.ttft_p99_ms:.0f}", p.errors])
    print(f"\ntidal day ({args.day_s:g} s, peak {args.peak_rps:g} req/s, {'default' if args.default_model else 'tiny'} model)")
    print_table(["run", "phase", "sent", "groups mean", "groups max", "TTFT p99 ms", "errors"], rows)
    on, off = reports
    ramp_on = next(p for p in on.phases if p.phase == "ramp").ttft_p99_ms
    ramp_off = next(p for p in off.phases if p.phase == "ramp").ttft_p99_ms
    for r in reports:
        print(f"pool {r.warm_pool}: sent {r.sent} ok {r.ok} errors {r.errors}; activations {len(r.activations_s)} "
              f"(max {max(r.activations_s, default=0) * 1000:.0f} ms); cold starts to serve {r.cold_starts}")
    if ramp_on and ramp_off:
        print(f"ramp TTFT p99: pool off {ramp_off:.0f} ms / pool on {ramp_on:.0f} ms = {ramp_off / ramp_on:.1f}x "
              f"(SLO {args.slo_ttft_ms:g} ms: on {'held' if ramp_on <= args.slo_ttft_ms else 'missed'}, "
              f"off {'held' if ramp_off <= args.slo_ttft_ms else 'missed'})")
    return 0 if on.errors == 0 and off.errors == 0 and on.ok == on.sent else 1


if __name__ == "__main__":
    sys.exit(main())
