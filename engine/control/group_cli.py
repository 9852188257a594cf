"""Group commands: `render` prints a backend's objects for a spec; `apply` and `delete` change the
desired state the controller keeps (engine/control/)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.runtime.errors import TideflowError


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
