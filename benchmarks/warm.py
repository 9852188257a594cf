"""Activating a standby group vs cold-starting the same group, under load, in one run.

Cold start: spawn the members, load and verify weights, build kernels, warm up, register.
Activation: the standby group's members allocate their KV cache, then the group is registered.
A load drill runs through the router the whole time the activations cycle (activate, serve, park);
it must lose no request. Targets: activation p99 under 1 s and at least 20x faster than cold start.

    python benchmarks/warm.py            # the default model (~115M parameters)
    python benchmarks/warm.py --tiny     # the 2-layer test model
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

from engine.offline.default_model import DEFAULT_CONFIG, TINY_CONFIG, write_default_model  # noqa: E402
from drills.load import run_load_drill  # noqa: E402
from drills.spec import LoadDrillSpec  # noqa: E402
from engine.group.groupset import GroupSetConfig, LocalGroupSet  # noqa: E402
from engine.group.manager import GroupState, ManagedGroup  # noqa: E402
from engine.group.spec import InferenceGroup  # noqa: E402

KEY_ENV = "TIDEFLOW_BENCH_KEY"


def spec(name: str, model_dir: Path, kv_bytes: int) -> InferenceGroup:
    return InferenceGroup.model_validate({
        "name": name, "version": "v1", "model": {"path": str(model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": kv_bytes}}]})


def wait(group: ManagedGroup, state: GroupState, timeout_s: float = 600) -> None:
    got = group.wait_for({state, GroupState.FAILED}, timeout_s)
    if got != state:
        raise SystemExit(f"group {group.spec.name} ended {got.value}: {[e.message for e in group.status.events][-3:]}")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of the default one")
    ap.add_argument("--cold-runs", type=int, default=3, help="cold starts to time")
    ap.add_argument("--activations", type=int, default=20, help="activate/park cycles to time")
    ap.add_argument("--kv-bytes", type=int, default=128 * 2**20, help="KV cache per member")
    ap.add_argument("--rate", type=float, default=4.0, help="load drill requests/s during the activations")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIDEFLOW_HOME", str(Path(tmp) / "home"))
        model_dir = write_default_model(Path(tmp) / "model", TINY_CONFIG if args.tiny else DEFAULT_CONFIG, seed=0)
        with LocalGroupSet(GroupSetConfig(model_dir=model_dir, model_name="default")) as gs:
            cold = []
            for i in range(args.cold_runs):
                t0 = time.perf_counter()
                g = gs.up(spec(f"cold-{i}", model_dir, args.kv_bytes))
                wait(g, GroupState.READY)
                cold.append(time.perf_counter() - t0)
                print(f"cold start {i}: {cold[-1]:.2f}s", file=sys.stderr)
                if i < args.cold_runs - 1:
                    g.drain_and_stop(5)
            # the last cold group keeps serving the load; the warm one cycles standby <-> ready under it
            warm = gs.up(spec("warm", model_dir, args.kv_bytes), standby=True)
            wait(warm, GroupState.STANDBY)
            os.environ[KEY_ENV] = gs.client_key
            cycle_s = 1.0
            drill_spec = LoadDrillSpec(url=gs.url, model="default", api_key_env=KEY_ENV, rate=args.rate,
                                       duration_s=args.activations * cycle_s + 1.0, prompt_len="uniform:16:64",
                                       output_len="fixed:16", expectations_suite=None, progress_bar=False,
                                       request_timeout_s=60)
            reports = []
            drill = threading.Thread(target=lambda: reports.append(run_load_drill(drill_spec)))
            drill.start()
            activation, park = [], []
            try:
                for _ in range(args.activations):
                    t0 = time.perf_counter()
                    activation.append(warm.activate())
                    time.sleep(max(0.0, cycle_s / 2 - (time.perf_counter() - t0)))
                    park.append(warm.park(drain_s=30))
                    time.sleep(max(0.0, cycle_s - (time.perf_counter() - t0)))
            finally:
                drill.join(timeout=600)
            report = reports[0]

    cold_p50, act_p50, act_p99 = statistics.median(cold), statistics.median(activation), quantile(activation, 0.99)
    print(f"\nwarm pool activation vs cold start ({'tiny' if args.tiny else 'default'} model, "
          f"{args.kv_bytes / 2**20:.0f} MiB KV, {args.rate:g} req/s through the router)")
    print_table(["path", "runs", "p50 s", "p99 s", "speedup vs cold p50"], [
        ["cold start (spawn, load, build, warm, register)", len(cold), cold_p50, quantile(cold, 0.99), 1.0],
        ["activate standby (KV alloc, ready, register)", len(activation), act_p50, act_p99, cold_p50 / act_p50],
        ["park (drain, release KV)", len(park), statistics.median(park), quantile(park, 0.99), cold_p50 / statistics.median(park)],
    ])
    print(f"\nactivation p99 {act_p99 * 1000:.0f} ms (target < 1000 ms); cold p50 / activation p99 = "
          f"{cold_p50 / act_p99:.0f}x (target >= 20x)")
    print(f"load during the cycles: sent {report.sent}, ok {report.ok}, error {report.error}"
          + (f" {report.steps[0].error_reasons}" if report.error else ""))
    held = act_p99 < 1.0 and cold_p50 / act_p99 >= 20 and report.error == 0 and report.ok == report.sent
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
