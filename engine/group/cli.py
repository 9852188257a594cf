"""Group commands: `tideflow group render SPEC.yaml --backend kubernetes` prints the manifests."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.errors import TideflowError


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("group", help="inference groups")
    group_sub = group.add_subparsers(dest="group_command", required=True)
    render = group_sub.add_parser("render", help="print what a backend would create for a group spec")
    render.add_argument("spec", type=Path, help="InferenceGroup spec (YAML), e.g. deployments/groups/tiny-pd.yaml")
    render.add_argument("--backend", choices=["kubernetes"], required=True, help="which backend's objects to render")
    render.add_argument("--namespace", default="default", help="Kubernetes namespace (default: default)")
    render.add_argument("--image", default=os.environ.get("TIDEFLOW_IMAGE", "tideflow:latest"),
                        help="engine container image (default: $TIDEFLOW_IMAGE or tideflow:latest)")
    render.add_argument("--standby", action="store_true", help="render the group silent (not routable)")
    render.set_defaults(func=_render)

    up = group_sub.add_parser("up", help="start a router and the group on loopback; serve until Ctrl-C")
    up.add_argument("spec", type=Path, nargs="+", help="InferenceGroup spec files (YAML)")
    up.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the spec's model.path)")
    up.add_argument("--port", type=int, default=None, help="router port (default: the spec's router.port)")
    up.add_argument("--model-name", default="default", help="model id clients ask for")
    up.add_argument("--ready-timeout-s", type=float, default=300.0)
    up.set_defaults(func=_up)

    apply = group_sub.add_parser("apply", help="desired state of one group, through the controller")
    apply.add_argument("spec", type=Path, help="InferenceGroup spec (YAML)")
    apply.add_argument("--name", default=None, help="group name (default: the spec's)")
    apply.add_argument("--version", default=None, help="group version (default: the spec's)")
    apply.add_argument("--weight", type=float, default=1.0, help="router weight once Ready (default 1)")
    apply.add_argument("--standby", action="store_true", help="loaded and warm, not routed (the warm pool)")
    apply.add_argument("--wait-s", type=float, default=0.0, help="wait up to this long for Ready/Standby/Failed")
    apply.set_defaults(func=lambda a: _control("group_apply", a))

    delete = group_sub.add_parser("delete", help="drain and stop one group, through the controller")
    delete.add_argument("name")
    delete.add_argument("--drain-s", type=float, default=10.0, help="wait this long for in-flight requests")
    delete.set_defaults(func=lambda a: _control("group_delete", a))

    status = group_sub.add_parser("status", help="state, members and events of the groups running here (JSON)")
    status.add_argument("name", nargs="?", help="one group (default: all)")
    status.set_defaults(func=_status)


def _control(verb: str, args: argparse.Namespace) -> int:
    from engine.control import cli

    return getattr(cli, verb)(args)


def _render(args: argparse.Namespace) -> int:
    from engine.group.k8s.manifests import render_yaml
    from engine.group.spec import InferenceGroup

    try:
        group = InferenceGroup.from_yaml(args.spec)
    except TideflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_yaml(group, args.namespace, args.image, standby=args.standby))
    return 0


def _up(args: argparse.Namespace) -> int:
    import signal
    import threading

    from engine.group.groupset import GroupSetConfig, LocalGroupSet
    from engine.group.manager import GroupState, SupervisionPolicy
    from engine.group.spec import InferenceGroup

    specs = [InferenceGroup.from_yaml(p) for p in args.spec]
    model_dir = args.model or Path(specs[0].model.expanded_path())
    port = args.port if args.port is not None else specs[0].router.port
    from engine.paths import home
    from engine.server.auth import load_api_keys
    from kernels.atomic_file import atomic_write_text

    given = load_api_keys()
    config = GroupSetConfig(model_dir=model_dir, model_name=args.model_name, router_port=port,
                            client_api_key=given[0] if given else None,
                            policy=SupervisionPolicy(ready_timeout_s=args.ready_timeout_s))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalGroupSet(config) as groupset:
        groups = [groupset.up(spec) for spec in specs]
        for g in groups:
            state = g.wait_for({GroupState.READY, GroupState.FAILED}, args.ready_timeout_s * 4)
            print(f"group {g.spec.name} {g.spec.version}: {state.value} ({g.status.events[-1].message})", flush=True)
        if given:
            key_note = "API key: the first of $TIDEFLOW_API_KEYS"
        else:
            key_file = home() / "router.key"
            atomic_write_text(key_file, groupset.client_key + "\n", mode=0o600)
            key_note = f"API key written to {key_file}"
        print(f"router: {groupset.url}/v1 ({key_note})", flush=True)
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


def _status(args: argparse.Namespace) -> int:
    import json

    from engine.group.manager import read_status_files
    from engine.paths import home

    states = [s for s in read_status_files(home() / "groups") if args.name in (None, s["name"])]
    if args.name and not states:
        print(f"error: no status for group {args.name!r} under {home() / 'groups'}", file=sys.stderr)
        return 1
    print(json.dumps(states, indent=2))
    return 0
