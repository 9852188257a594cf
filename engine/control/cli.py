"""`tideflow controller` (foreground service), `tideflow status`, `tideflow down`, and the bodies of
`tideflow group apply` / `tideflow group delete`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.runtime.errors import TideflowError
from engine.api import connection_limits

if TYPE_CHECKING:
    from engine.control.leader import LeaseElector


POD_NAME_ENV = "POD_NAME"  # the controller's identity in the Lease (deployments/kubernetes/controller.yaml sets it)
EXIT_LEADERSHIP_LOST = 4


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser("controller", help="run the control plane (owns the router, groups, warm pools)")
    c.add_argument("--host", default="127.0.0.1", help="bind address of the API, the router and the members")
    c.add_argument("--port", type=int, default=0, help="control API port (default: the last one, else any free)")
    c.add_argument("--router-port", type=int, default=0, help="router port (default: the last one, else any free)")
    c.add_argument("--router-replicas", type=int, default=2,
                   help="local: router processes sharing the router port (SO_REUSEPORT); one that dies is started "
                        "again and the others serve meanwhile. Each also answers on a port of its own, where the "
                        "canary judge, the autoscaler and Prometheus (GET /v1/targets) read its metrics and samples")
    c.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="local: one more `tideflow router` flag for every replica (repeatable), e.g. "
                        "--router-arg=--kv-routing=approximate")
    c.add_argument("--model-dir", type=Path, default=None,
                   help="router tokenizer / default checkpoint (default: $TIDEFLOW_HOME/models/default, written if missing)")
    c.add_argument("--model-name", default="default", help="model id clients ask the router for")
    c.add_argument("--backend", choices=["local", "kubernetes"], default=None,
                   help="where members run (default: $TIDEFLOW_BACKEND, else local)")
    c.add_argument("--namespace", default=None, help="kubernetes: namespace of the groups (default: $TIDEFLOW_NAMESPACE)")
    c.add_argument("--image", default="tideflow:latest", help="kubernetes: image of the group members")
    c.add_argument("--router-url", default="http://tideflow-router:8000",
                   help="kubernetes: the router Service clients use (deployments/kubernetes/router.yaml)")
    c.add_argument("--no-capacity-check", dest="capacity_check", action="store_false",
                   help="local: start groups even when their members' estimated memory exceeds this host's available "
                        "memory (the check refuses them before any member starts)")
    c.add_argument("--tls", choices=["auto", "on", "off"], default="auto",
                   help="local: TLS on every hop from the fleet CA in $TIDEFLOW_HOME/tls, mutual TLS to members "
                        "(auto: on when --host is not a loopback address)")
    c.add_argument("--cert-lifetime-h", type=float, default=24.0,
                   help="local: hours a fleet certificate is valid; each is issued again with a third of its life left")
    connection_limits.add_arguments(c)
    c.set_defaults(func=_controller)

    r = subparsers.add_parser("router-replica", help="one more router serving the groups of this home's controller")
    r.add_argument("--host", default="127.0.0.1", help="bind address")
    r.add_argument("--port", type=int, required=True, help="OpenAI API port of this replica")
    r.set_defaults(func=_router_replica)

    s = subparsers.add_parser("status", help="the fleet as the controller sees it")
    s.add_argument("--json", action="store_true", help="machine-readable")
    s.add_argument("--events", type=int, default=5, metavar="N",
                   help="the controller's last N events after the groups (0: none; `--json` leaves them out)")
    s.set_defaults(func=_status)

    d = subparsers.add_parser("down", help="stop every group, the router and the controller")
    d.add_argument("--timeout-s", type=float, default=120.0, help="wait this long for everything to stop")
    d.set_defaults(func=_down)


def _controller(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.control import discovery
    from engine.api.connections import server_config
    from engine.control.api import create_control_app
    from engine.control.controller import Controller
    from engine.control.home_lock import HomeLock
    from engine.control.runtime import BACKEND_ENV, ControllerConfig
    from engine.offline.default_model import write_default_model
    from engine.group.capacity import CapacityCheck
    from engine.runtime.paths import default_model_dir
    from engine.runtime.process import start_ticks
    from engine.runtime.tls import TlsIdentity

    held = HomeLock() if (args.backend or os.environ.get(BACKEND_ENV, "local")) == "local" else None
    model_dir = args.model_dir or default_model_dir()
    if args.model_dir is None and not (model_dir / "config.json").exists():
        write_default_model(model_dir)
    chosen = {k: v for k, v in (("backend", args.backend), ("namespace", args.namespace)) if v}
    config = ControllerConfig(model_dir=model_dir, model_name=args.model_name, host=args.host, port=args.port,
                              router_port=args.router_port, router_replicas=args.router_replicas, router_args=args.router_arg, image=args.image,
                              router_url=args.router_url, tls=args.tls, cert_lifetime_h=args.cert_lifetime_h,
                              capacity_check=CapacityCheck(enabled=args.capacity_check), **chosen)
    if config.backend == "kubernetes" and args.tls == "on":
        raise TideflowError("--tls on is for the local backend: on kubernetes the fleet CA is not kept in a Secret "
                            "yet; say --tls off and encrypt pod-to-pod traffic with a mesh (docs/security.md#tls)")
    if config.backend == "kubernetes" and not config.port:
        raise TideflowError("--port is needed on kubernetes: the router Deployment reaches the controller's Service there")
    elector = _lead(config) if config.backend == "kubernetes" else None
    if elector is not None:
        elector.keep(on_lost=_leadership_lost)  # from now on: adoption at start may take a while
    controller = Controller(config).start()
    port = controller.port
    info = discovery.ControllerInfo(url=controller.url, admin_key=controller.admin_key,
                                    pid=os.getpid(), ticks=start_ticks(os.getpid()))
    server: uvicorn.Server | None = None

    def on_down() -> None:
        discovery.unregister(info.pid)  # before exiting: nobody may find a controller that is going away
        server.should_exit = True

    limits = connection_limits.from_args(args)
    app = create_control_app(controller, on_down=on_down, body_timeout_s=limits.body_timeout_s)
    # the controller's own certificate, when TLS is on: the local runtime put the fleet's into its environment
    server = uvicorn.Server(server_config(app, limits, host=args.host, port=port, log_level="warning",
                                          timeout_graceful_shutdown=5, identity=TlsIdentity.from_env()))
    discovery.register(info, controller.client_key)
    print(f"controller: {info.url} (pid {info.pid}); router: {controller.router_url}/v1 "
          f"(API key in {discovery.router_key_path()})", flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again under the handler it found:
    # this one turns that into an exit through `finally`, so the registration never outlives the controller.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server.run()
    finally:
        controller.close(stop_fleet=False)  # after `down` a no-op; on SIGTERM the fleet keeps serving
        discovery.unregister(info.pid)
        if held is not None:
            held.release()  # last: no second controller may start while this one still acts on the home
        if elector is not None:
            elector.release()  # last, likewise: the other replica leads at once
    return 0


def _lead(config) -> LeaseElector:
    """On Kubernetes: campaign for the controller's Lease, answering /health (alive) and /ready 503 (not the
    leader) on the API's port meanwhile; returns once this replica holds it and its pod is labelled leader."""
    import socket

    from engine.control.api import create_standby_app
    from engine.control.leader import LeaseElector
    from engine.group.k8s.backend import api_client
    from engine.api.inproc import serve_in_thread

    identity = os.environ.get(POD_NAME_ENV) or socket.gethostname()
    elector = LeaseElector(api_client(), config.namespace, identity, pod=os.environ.get(POD_NAME_ENV))
    with serve_in_thread(create_standby_app(lambda: elector.holder), "controller-standby", host=config.host,
                         port=config.port):
        elector.campaign()
    return elector


def _leadership_lost(why: str) -> None:
    """Another replica may lead from now on: this one must stop acting at once, so it exits (Kubernetes starts it
    again, as a candidate). Its groups keep serving; the new leader adopts them."""
    print(f"tideflow controller: lost the Lease ({why}); exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_LEADERSHIP_LOST)


def _exit_on_signal(_signum: int, _frame) -> None:
    raise SystemExit(0)  # a stop that was asked for, carried out


def _router_replica(args: argparse.Namespace) -> int:
    """`tideflow router` watching this home's controller, with the keys from its store (the same client key,
    so clients may use any replica). Replaces this process: a supervisor sees the router itself."""
    from engine.control import discovery
    from engine.control.local_runtime import router_env
    from engine.control.store import Store
    from engine.runtime.paths import home
    from engine.runtime.pki import identity_paths
    from engine.runtime.process import loopback_members, tideflow_argv

    info = discovery.find()
    if info.pid is None:
        raise TideflowError(f"{discovery.URL_ENV} names a remote controller: run `tideflow router --controller-url "
                            f"{info.url}` there with its keys (deployments/kubernetes/router.yaml does)")
    store = Store(home() / "controller.db")
    try:
        env, model_dir, model_name = router_env(store), store.setting("model_dir"), store.setting("model_name")
    finally:
        store.close()
    if not model_dir or not model_name:
        raise TideflowError(f"the controller at {info.url} recorded no model; restart it with `tideflow controller`")
    if info.url.startswith("https://"):  # the controller serves TLS: this replica shows the routers' certificate
        env.update(identity_paths(home() / "tls", "router").env())
    argv = tideflow_argv("router", "--host", args.host, "--port", str(args.port), "--model-name", model_name,
                         "--model-dir", model_dir, "--controller-url", info.url, *loopback_members(args.host))
    os.execve(argv[0], argv, {**os.environ, **env})
    return 0  # not reached


def _status(args: argparse.Namespace) -> int:
    from engine.control.client import ControlClient

    if not 0 <= args.events <= 10000:
        raise ValueError(f"--events {args.events}: 0 to 10000")
    with ControlClient.connect() as client:
        status = client.status()
        events = client.events(args.events) if args.events and not args.json else []
    if args.json:
        print(status.model_dump_json(indent=2))
        return 0
    pids = ", ".join(map(str, status.router_pids)) or "-"
    print(f"router: {status.router_url}/v1 (pids {pids})   controller pid {status.controller_pid}   "
          f"router replicas watching: {len(status.router_replicas)}")
    if not status.groups:
        print("no groups")
    for g in status.groups:
        drills = f" (+{g.drill_rebuilds} drill)" if g.drill_rebuilds else ""
        print(f"{g.name:24} {g.version:8} {g.state.value:9} weight {g.weight:<6g} restarts {g.restarts}{drills}  {g.message}")
        if g.desired is not None and (g.desired.standby != g.standby or g.desired.weight != g.weight):
            print(f"    desired: {'standby' if g.desired.standby else 'serving'} at weight {g.desired.weight:g}")
        if g.decision is not None:
            print(f"    controller: {'standby' if g.decision.standby else 'serving'} at weight {g.decision.weight:g}: "
                  f"{g.decision.reason}")
        for c in g.conditions:
            if not c.healthy:
                print(f"    {c.type}={c.status} {c.reason} since {c.last_transition_time}: {c.message}")
        if g.expert_moves is not None:
            moves = g.expert_moves
            print(f"    experts moved live: {moves.applied} rebalances applied ({moves.stall_s:.2f} s of stalled steps), "
                  f"{moves.refused} refused")
        for m in g.members:
            print(f"    {m.role:9} {m.instance}/{m.rank}  {m.phase:8} pid {m.pid}  {m.endpoint}")
    if events:
        print("events:")
    for e in events:
        print(f"  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.at))}  {e.kind:11} {e.message}")
    return 0


def _down(args: argparse.Namespace) -> int:
    """Through the controller when it answers; else straight from its store (it died): nothing stays."""
    from engine.control import discovery
    from engine.control.client import ControlClient
    from engine.control.local_runtime import stop_recorded_fleet
    from engine.runtime.process import start_ticks

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
    if args.wait_s and view.state not in (GroupState.READY, GroupState.STANDBY):
        waited = "" if view.state == GroupState.FAILED else f" after {args.wait_s:g}s"
        print(f"error: group {view.name} is {view.state.value}{waited}: {view.message}", file=sys.stderr)
        return 1
    return 0 if view.state != GroupState.FAILED else 1


def group_delete(args: argparse.Namespace) -> int:
    from engine.control.client import ControlClient

    with ControlClient.connect() as client:
        client.delete(args.name, args.drain_s)
    print(f"deleted {args.name}", file=sys.stderr)
    return 0
