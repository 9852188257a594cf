"""`tideflow controller` (foreground service), `tideflow status`, `tideflow down`, and the bodies of
`tideflow group apply` / `tideflow group delete`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from engine.errors import TideflowError


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser("controller", help="run the control plane (owns the router, groups, warm pools)")
    c.add_argument("--host", default="127.0.0.1", help="bind address of the API, the router and the members")
    c.add_argument("--port", type=int, default=0, help="control API port (default: any free port)")
    c.add_argument("--router-port", type=int, default=0, help="router port (default: the last one, else any free)")
    c.add_argument("--model-dir", type=Path, default=None,
                   help="router tokenizer / default checkpoint (default: $TIDEFLOW_HOME/models/default, written if missing)")
    c.add_argument("--model-name", default="default", help="model id clients ask the router for")
    c.set_defaults(func=_controller)

    s = subparsers.add_parser("status", help="the fleet as the controller sees it")
    s.add_argument("--json", action="store_true", help="machine-readable")
    s.set_defaults(func=_status)

    d = subparsers.add_parser("down", help="stop every group, the router and the controller")
    d.add_argument("--timeout-s", type=float, default=120.0, help="wait this long for everything to stop")
    d.set_defaults(func=_down)


def _controller(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.control import discovery
    from engine.control.api import create_control_app
    from engine.control.controller import Controller, ControllerConfig
    from engine.default_model import write_default_model
    from engine.paths import default_model_dir
    from engine.process import free_port, start_ticks

    try:
        running = discovery.find()
    except discovery.NoController:
        running = None
    if running is not None and running.local_process_alive():
        raise TideflowError(f"a controller already runs here (pid {running.pid}, {running.url}); "
                            "`tideflow down` stops it")
    model_dir = args.model_dir or default_model_dir()
    if args.model_dir is None and not (model_dir / "config.json").exists():
        write_default_model(model_dir)
    port = args.port or free_port(args.host)
    config = ControllerConfig(model_dir=model_dir, model_name=args.model_name, host=args.host, port=port,
                              router_port=args.router_port)
    controller = Controller(config).start()
    info = discovery.ControllerInfo(url=f"http://{args.host}:{port}", admin_key=controller.admin_key,
                                    pid=os.getpid(), ticks=start_ticks(os.getpid()))
    server: uvicorn.Server | None = None

    def on_down() -> None:
        discovery.unregister(info.pid)  # before exiting: nobody may find a controller that is going away
        server.should_exit = True

    app = create_control_app(controller, on_down=on_down)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    discovery.register(info, controller.client_key)
    print(f"controller: {info.url} (pid {info.pid}); router: {controller.router_url}/v1 "
          f"(API key in {discovery.router_key_path()})", flush=True)
    try:
        server.run()
    finally:
        controller.close(stop_fleet=False)  # after `down` a no-op; on SIGTERM the fleet keeps serving
        discovery.unregister(info.pid)
    return 0


def _status(args: argparse.Namespace) -> int:
    from engine.control.client import ControlClient

    with ControlClient.connect() as client:
        status = client.status()
    if args.json:
        print(status.model_dump_json(indent=2))
        return 0
    print(f"router: {status.router_url}/v1   controller pid {status.controller_pid}")
    if not status.groups:
        print("no groups")
    for g in status.groups:
        print(f"{g.name:24} {g.version:8} {g.state.value:9} weight {g.weight:<6g} restarts {g.restarts}  {g.message}")
        for m in g.members:
            print(f"    {m.role:9} {m.instance}/{m.rank}  {m.phase:8} pid {m.pid}  {m.endpoint}")
    return 0


def _down(args: argparse.Namespace) -> int:
    """Through the controller when it answers; else straight from its store (it died): nothing stays."""
    from engine.control import discovery
    from engine.control.client import ControlClient
    from engine.control.controller import stop_recorded_fleet
    from engine.process import start_ticks

    try:
        info = discovery.find()
    except discovery.NoController:
        info = None
    if info is not None:
        with ControlClient(info.url, info.admin_key, timeout_s=args.timeout_s) as client:
            if client.health():
                client.down()
                deadline = time.monotonic() + args.timeout_s
                while info.pid is not None and start_ticks(info.pid) == info.ticks and time.monotonic() < deadline:
                    time.sleep(0.1)
                print("down: every group, the router and the controller stopped")
                return 0
    stopped = stop_recorded_fleet()
    if info is not None and info.pid is not None:
        discovery.unregister(info.pid)
    print(f"down: no controller answered; stopped {stopped} recorded processes")
    return 0


def group_apply(args: argparse.Namespace) -> int:
    from engine.control.client import ControlClient
    from engine.group.manager import GroupState
    from engine.group.spec import InferenceGroup

    spec = InferenceGroup.from_yaml(args.spec)
    update = {k: v for k, v in (("name", args.name), ("version", args.version)) if v}
    spec = InferenceGroup.model_validate({**spec.model_dump(), **update})
    with ControlClient.connect() as client:
        view = client.apply(spec, weight=args.weight, standby=args.standby)
        if args.wait_s:
            view = client.wait_for(spec.name, {GroupState.READY, GroupState.STANDBY, GroupState.FAILED}, args.wait_s)
    print(json.dumps({"name": view.name, "version": view.version, "state": view.state.value, "weight": view.weight}))
    return 0 if view.state != GroupState.FAILED else 1


def group_delete(args: argparse.Namespace) -> int:
    from engine.control.client import ControlClient

    with ControlClient.connect() as client:
        client.delete(args.name, args.drain_s)
    print(f"deleted {args.name}", file=sys.stderr)
    return 0
