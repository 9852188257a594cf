"""Drill commands: `tideflow drill load ...` (each drill kind is one sub-subcommand of `drill`)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from engine.runtime.paths import home


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    drill = subparsers.add_parser("drill", help="load and fault drills against a running server")
    kinds = drill.add_subparsers(dest="drill_command", required=True)
    _add_load(kinds)
    _add_fault(kinds)


def _rates(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps wants comma-separated rates like 1,2,4,8, got {text!r}") from None


def _add_load(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("load", help="open-loop load (Poisson or step) against an OpenAI-compatible API",
                         description="Sends requests on a clock, measures TTFT/TPOT/ITL/throughput/goodput per step, "
                                     "finds the capacity watermark, writes CSV/JSON/PNG reports and validates them.")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model id to request")
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="env var holding the API key")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--rate", type=float, default=None, help="single step: requests/s")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="single step: seconds of arrivals")
    p.add_argument("--steps", type=_rates, default=None, metavar="R1,R2,...", help="step load: rates in req/s")
    p.add_argument("--hold", type=float, default=None, metavar="S", help="step load: seconds per step")
    p.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    p.add_argument("--prompt-len", default="uniform:16:64", metavar="DIST",
                   help="fixed:N | uniform:A:B | normal:MU:SIGMA[:MIN:MAX] | lognormal:MEDIAN:SIGMA[:MIN:MAX]")
    p.add_argument("--output-len", default="fixed:32", metavar="DIST", help="max_tokens law (same forms)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE.jsonl", help="{prompt, max_tokens, arrival_s?} lines")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="checkpoint dir: calibrate prompt lengths exactly")
    p.add_argument("--respect-eos", action="store_true", help="let the server stop at EOS (default: ignore_eos)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-quantile", type=float, default=0.9, help="quantile that must meet the SLOs")
    p.add_argument("--max-error-rate", type=float, default=0.01)
    p.add_argument("--max-in-flight", type=int, default=1024, help="arrivals past this many open requests are errors")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="per-request timeout")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="report directory (default: $TIDEFLOW_HOME/drills/load-<UTC time>)")
    p.add_argument("--no-validate", action="store_true", help="skip the Great Expectations suite")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_load)


def _load(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from drills.load import run_load_drill
    from drills.spec import LoadDrillSpec

    out = args.out or home() / "drills" / f"load-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    fields = {
        "url": args.url, "model": args.model, "api_key_env": args.api_key_env, "endpoint": args.endpoint,
        "rate": args.rate, "duration_s": args.duration, "steps": args.steps, "hold_s": args.hold,
        "arrival": args.arrival, "prompt_len": args.prompt_len, "output_len": args.output_len, "trace": args.trace,
        "tokenizer_dir": args.tokenizer_dir, "ignore_eos": not args.respect_eos, "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms, "slo_quantile": args.slo_quantile, "max_error_rate": args.max_error_rate,
        "max_in_flight": args.max_in_flight, "request_timeout_s": args.timeout, "seed": args.seed, "out_dir": out,
        "progress_bar": not args.no_progress,
    }
    if args.no_validate:
        fields["expectations_suite"] = None
    try:
        spec = LoadDrillSpec(**fields)
        report = run_load_drill(spec)
    except (ValidationError, ValueError, OSError) as e:
        print(f"drill load: {e}", file=sys.stderr)
        return 2
    _print_steps(report)
    print(f"sent {report.sent} = ok {report.ok} + error {report.error}")
    print("capacity watermark: " + (f"{report.capacity_rps:g} req/s (step {report.capacity_step})"
                                     if report.capacity_rps is not None else "none (the first step already misses)"))
    print(f"reports in {out}")
    if report.expectations is not None and not report.expectations.success:
        print("expectations failed: " + "; ".join(report.expectations.failed), file=sys.stderr)
        return 1
    return 0


def _print_steps(report) -> None:
    cols = ["step", "offered_rate", "sent", "ok", "error", "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90",
            "output_tok_s", "req_s", "goodput_req_s", "slo_held"]

    _print_table([{c: getattr(s, c) for c in cols} for s in report.steps])
    for s in report.steps:
        for reason, n in s.error_reasons.items():
            print(f"  step {s.step}: {n} x {reason}")


def _add_fault(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("fault", help="kill one member of a group under load (through the controller), measure the rebuild",
                         description="Brings the spec's group up through the controller (one is started when none "
                                     "answers), runs greedy Poisson load through the router, has the controller SIGKILL "
                                     "one member per repeat and reports ejection and recovery times, migrated requests, "
                                     "the longest stream pauses, and lost or duplicated tokens (the streams open at the "
                                     "kill are replayed undisturbed and compared). Exit 0 only when nothing was lost. "
                                     "The group is deleted afterwards, so a spec naming a group the fleet already "
                                     "has is refused.")
    p.add_argument("spec", type=Path, help="InferenceGroup spec (YAML)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the spec's model.path)")
    p.add_argument("--target", choices=["prefill", "decode", "colocated", "encoder", "expert", "router", "controller"],
                   default="decode", help="a member of the group, or the router (the controller starts a new one) "
                                          "or the controller (started again here with its own command line)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", type=float, default=4.0, help="background load, requests/s")
    p.add_argument("--duration", type=float, default=5.0, metavar="S", help="seconds of load per repeat")
    p.add_argument("--kill-after", type=float, default=1.0, metavar="S", help="seconds of load before the kill")
    p.add_argument("--standby", action="store_true",
                   help="drill 1 group + warm pool: a silent copy of the group takes over when the member dies")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="report directory: fault.json, fault.csv, fault.png (default: $TIDEFLOW_HOME/drills/fault-<UTC time>)")
    p.set_defaults(func=_fault)


def _fault(args: argparse.Namespace) -> int:
    import os

    from engine.control import discovery
    from engine.control.client import ControlClient
    from engine.control.launch import ensure_controller, stop_controller
    from drills.fault import FaultDrillSpec, run_fault_drill
    from drills.fault_report import write_fault_report
    from drills.spec import LoadDrillSpec
    from engine.group.manager import GroupState
    from engine.group.spec import InferenceGroup

    spec = InferenceGroup.from_yaml(args.spec)
    if args.model:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"path": str(args.model)})})
    warm = spec.model_copy(update={"name": f"{spec.name}-warm"}) if args.standby else None
    started = ensure_controller()
    try:
        with ControlClient.connect() as client:
            taken = sorted({spec.name, *([warm.name] if warm else [])} & {g.name for g in client.status().groups})
            if taken:  # this drill deletes what it brought up: never a group the fleet already had
                print(f"drill fault: the fleet already has {', '.join(taken)}; the drill brings up and deletes a "
                      "group of its own: give the spec another name (or drill the fleet's group with the "
                      "fault-drill flow, which never deletes it)", file=sys.stderr)
                return 2
            client.apply(spec)
            if warm is not None:
                client.apply(warm, standby=True)
            try:
                for name, want in ((spec.name, GroupState.READY), *(((warm.name, GroupState.STANDBY),) if warm else ())):
                    view = client.wait_for(name, {want, GroupState.FAILED}, 600)
                    if view.state != want:
                        print(f"drill fault: group {name} did not come up: {view.message}", file=sys.stderr)
                        return 1
                os.environ["TIDEFLOW_DRILL_KEY"] = discovery.router_key()
                load = LoadDrillSpec(url=client.status().router_url, model="default", api_key_env="TIDEFLOW_DRILL_KEY",
                                     rate=args.rate, duration_s=args.duration, expectations_suite=None,
                                     progress_bar=False)
                report = run_fault_drill(client, FaultDrillSpec(group=spec.name, target=args.target,
                                                                repeats=args.repeats, kill_after_s=args.kill_after,
                                                                load=load), progress=print)
            finally:
                client.delete(spec.name)
                if warm is not None:
                    client.delete(warm.name)
    finally:
        if started is not None:
            stop_controller(started)
    _print_table(report.table())
    print(f"sent {report.sent} = ok {report.ok} + error {report.errors}: "
          f"{'every request accounted for' if report.accounted else 'REQUESTS UNACCOUNTED'}; "
          f"{report.migrated} migrated, lost tokens {report.lost_tokens}, duplicated {report.duplicated_tokens}")
    for why, n in report.error_reasons.items():
        print(f"  {n} x {why}")
    out = args.out or home() / "drills" / f"fault-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    files = write_fault_report(report, out)
    print(f"report: {files['json']}, {files['table']}, {files['plot']}")
    return 0 if report.clean else 1


def _print_table(rows: list[dict]) -> None:
    """Right-aligned columns, one line per row (floats to 4 significant digits)."""
    if not rows:
        return
    cols = list(rows[0])
    cells = [cols] + [["-" if r[c] is None else f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols]
                      for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
