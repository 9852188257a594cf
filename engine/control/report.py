"""The fleet as markdown: what `tideflow status` shows, for the artifact every fleet-changing flow run ends with."""

from __future__ import annotations

import time

from engine.control.models import FleetStatus, GroupView
from engine.group.manager import GroupState


def fleet_markdown(status: FleetStatus, title: str = "Fleet") -> str:
    """Groups (desired and observed state, weight, restarts, the conditions that are not as they should be, last
    event), each member (phase, pid, endpoint), the canary and the lease."""
    lines = [f"### {title}", "",
             f"router `{status.router_url}/v1` (pids {', '.join(map(str, status.router_pids)) or '-'}), controller pid {status.controller_pid}, "
             f"backend {status.backend}, {len(status.router_replicas)} router replica(s) watching", ""]
    if not status.groups:
        lines.append("**no groups**")
    else:
        total = sum(g.weight for g in status.groups if g.state == GroupState.READY)
        lines += ["| group | version | desired | state | weight | traffic share | restarts | drill rebuilds | conditions "
                  "| members | last event |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in status.groups:
            share = f"{100 * g.weight / total:.0f} %" if total and g.state == GroupState.READY else "-"
            members = "<br>".join(f"{m.role} {m.instance}/{m.rank} {m.phase} pid {m.pid}" for m in g.members) or "-"
            lines.append(f"| {g.name} | {g.version} | {_desired(g)} | {g.state.value} | {g.weight:g} | {share} | "
                         f"{g.restarts} | {g.drill_rebuilds} | {_conditions(g)} | {members} | {_cell(g.message)} |")
    if status.canary is not None:
        c = status.canary
        what = c.decision or f"step {c.step} at {c.percent:g} %"
        lines += ["", f"latest canary: {c.canary} over {c.stable}: **{what}** {_cell(c.reason)}"]
    if status.lease is not None:
        lines += ["", f"changing the fleet now: {status.lease.purpose} ({status.lease.holder}, "
                      f"for {time.time() - status.lease.acquired_at:.0f}s)"]
    return "\n".join(lines) + "\n"


def _desired(g: GroupView) -> str:
    """The user's word, and the controller's decision over it when there is one."""
    if g.desired is None:
        return "deleted"
    said = f"{'standby' if g.desired.standby else 'serving'} at {g.desired.weight:g}"
    if g.decision is not None:
        said += (f"<br>controller: {'standby' if g.decision.standby else 'serving'} at {g.decision.weight:g} "
                 f"({_cell(g.decision.reason)})")
    return said


def _conditions(g: GroupView) -> str:
    """Only those not as they should be, each with its reason and since when."""
    odd = [f"{c.type}={c.status} {c.reason} since {c.last_transition_time}" for c in g.conditions if not c.healthy]
    return "<br>".join(_cell(o) for o in odd) or "as they should be"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]
