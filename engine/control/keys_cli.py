"""`tideflow keys rotate ROLE [--grace 10m]`: a new key at once, the old one for its grace (engine.control.keys)."""

from __future__ import annotations

import argparse
import re


def _duration(text: str) -> float:
    """`600`, `90s`, `10m`, `2h`: seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give seconds, or 90s, 10m, 2h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="the fleet's keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("rotate", help="a new key for ROLE, working at once; the old one works for --grace, then is "
                                       "refused; routers and members take it without a restart")
    p.add_argument("role", choices=["client", "admin", "routes", "upstream"],
                   help="client: clients -> router ($TIDEFLOW_HOME/router.key gets the new one); admin: the control "
                        "API ($TIDEFLOW_HOME/controller.json); routes: routers -> the controller's route set; "
                        "upstream: routers and the controller -> members (every member accepts the new key before "
                        "anyone sends it)")
    p.add_argument("--grace", type=_duration, default=600.0, metavar="DURATION",
                   help="how long the old key keeps working (default 10m; 0: refused at once)")
    p.set_defaults(func=_rotate)


def _rotate(args: argparse.Namespace) -> int:
    from engine.control.client import ControlClient

    with ControlClient.connect() as client:
        done = client.rotate_key(args.role, args.grace)
    print(f"{done.role} key rotated: the new one works now"
          + (f", on {done.routers} router replica(s)" if done.routers else "")
          + f"; the old one until {done.old_until:.0f} (unix time, {done.grace_s:g} s of grace)")
    return 0
