"""`tideflow release` runs the whole release flow; `tideflow ui` serves every deployment to a local Prefect UI."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    rel = subparsers.add_parser("release", help="build kernels -> publish -> deploy -> canary -> drills (Prefect flow)")
    rel.add_argument("--ci", action="store_true", help="exit non-zero unless the canary was promoted and every drill held")
    rel.add_argument("--keep-serving", action="store_true",
                     help="leave the controller (and the fleet) running after the flow; `tideflow down` stops it")
    rel.set_defaults(func=_release)

    ui = subparsers.add_parser("ui", help="start a local Prefect server and serve every tideflow deployment")
    ui.add_argument("--port", type=int, default=4200, help="Prefect UI/API port on 127.0.0.1")
    ui.add_argument("--keep-serving", action="store_true", help="leave a controller started here running on exit")
    ui.add_argument("--prefect-file", type=Path, default=None,
                    help="deployments to serve (default: flows/prefect.yaml, shipped inside the package)")
    ui.set_defaults(func=_ui)


def _prefect_home() -> None:
    from engine.runtime.paths import home

    os.environ.setdefault("PREFECT_HOME", str(home() / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect creates only the last level
    # The first start migrates a fresh SQLite database: on 2 cores that outlasts Prefect's 20 s default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    # Prefect's telemetry service writes its session row into the same SQLite database the runs are written to,
    # and lost that race in `make run` with a "database is locked" traceback (Prefect issue 18934); a release
    # pipeline has nothing to report to Prefect's analytics, and its machines often cannot reach them.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _release(args: argparse.Namespace) -> int:
    _prefect_home()
    _stop_on_sigterm()
    from engine.control.launch import ensure_controller, stop_controller
    from flows.release import ReleaseFailed, ReleaseParams, ReleaseSummary, release

    t0 = time.monotonic()
    started = ensure_controller()  # None: a controller already serves this home, and it stays as it is
    try:
        state = release(ReleaseParams(), return_state=True)
        took = time.monotonic() - t0
        s = state.result(raise_on_failure=False)
        s = s.summary if isinstance(s, ReleaseFailed) else s
        if not isinstance(s, ReleaseSummary):  # it failed before it could sum up
            print(f"release failed after {took:.0f}s: {state.message}", file=sys.stderr)
            return 1
        print(f"\nrelease {'finished' if state.is_completed() else 'FAILED (' + state.name + ')'} in {took:.0f}s")
        print(f"  kernels verified: {s.kernels_ok}")
        print(f"  weights: {s.weights['v1']} (stable), {s.weights['v2']} (new)")
        print(f"  canary: {s.canary_decision} - {s.canary_reason}")
        print(f"  serving weights: {s.serving}; traffic during the canary: {s.canary_traffic}")
        print(f"  load drill: capacity {s.load_capacity_rps} req/s, {s.load_ok}/{s.load_sent} ok")
        print(f"  fault drill: rebuilt in {s.fault_recover_s} s, every request accounted for: {s.fault_accounted}, "
              f"{s.fault_errors} errors, {s.fault_migrated} migrated, lost tokens {s.fault_lost_tokens}, "
              f"duplicated {s.fault_duplicated_tokens}")
        print(f"  runs, artifacts and plots: `tideflow ui` (Prefect data in {os.environ['PREFECT_HOME']})")
        if args.keep_serving or started is None:
            print(f"  serving on {s.router}/v1 (`tideflow status`; `tideflow down` stops it)")
        return 0 if state.is_completed() or not args.ci else 1
    finally:
        if started is not None and not args.keep_serving:
            print(f"release: {stop_controller(started)}")


def _stop_on_sigterm() -> None:
    """SIGTERM ends the command through its `finally` (what it started is stopped), as Ctrl-C does.
    Prefect's runner installs its own graceful handler once serving, which returns the same way."""

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _ui(args: argparse.Namespace) -> int:
    _prefect_home()
    _stop_on_sigterm()
    from engine.control.launch import ensure_controller, stop_controller
    from engine.runtime.paths import home
    from engine.runtime.process import Child, wait_http_ok

    api = f"http://127.0.0.1:{args.port}/api"
    server = Child("prefect-server", [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                      "--port", str(args.port)], home() / "logs" / "prefect-server.log",
                   env={"PREFECT_UI_API_URL": api})  # the UI's pages call this API (its default is port 4200)
    controller = None
    try:
        if not wait_http_ok(api + "/health", timeout_s=120, child=server):
            print(f"prefect server did not start: {server.log_tail()}", file=sys.stderr)
            return 1
        controller = ensure_controller()
        os.environ["PREFECT_API_URL"] = api
        from prefect import serve

        from flows.deployments import SHIPPED_PREFECT_FILE, load_deployments

        deployments = load_deployments(args.prefect_file or SHIPPED_PREFECT_FILE)
        print(f"Prefect UI: http://127.0.0.1:{args.port} - serving {len(deployments)} deployments against the "
              f"controller ({'started here' if controller else 'already running'}); Ctrl-C stops", flush=True)
        serve(*deployments, print_starting_message=False)
    except KeyboardInterrupt:
        pass
    finally:
        if controller is not None and not args.keep_serving:
            print(f"tideflow ui: {stop_controller(controller)}", flush=True)
        elif controller is None:
            print("tideflow ui: the controller was already running before the UI started; it keeps serving", flush=True)
        server.stop()
    return 0
