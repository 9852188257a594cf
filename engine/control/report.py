"""The fleet as markdown: what `tideflow status` shows, for the artifact every fleet-changing flow run ends with."""

from __future__ import annotations

import time

from engine.control.models import FleetStatus
from engine.group.manager import GroupState


def fleet_markdown(status: FleetStatus, title: str = "Fleet") -> str:
    """Groups (state, weight, restarts, last event), each member (phase, pid, endpoint), the canary and the lease."""
    lines = [f"### {title}", "",
             f"router `{status.router_url}/v1` (pid {status.router_pid}), controller pid {status.controller_pid}, "
             f"backend {status.backend}, {len(status.router_replicas)} router replica(s) watching", ""]
    if not status.groups:
        lines.append("**no groups**")
    else:
        total = sum(g.weight for g in status.groups if g.state == GroupState.READY)
        lines += ["| group | version | state | weight | traffic share | restarts | drill rebuilds | members | last event |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for g in status.groups:
            share = f"{100 * g.weight / total:.0f} %" if total and g.state == GroupState.READY else "-"
            members = "<br>".join(f"{m.role} {m.instance}/{m.rank} {m.phase} pid {m.pid}" for m in g.members) or "-"
            lines.append(f"| {g.name} | {g.version} | {g.state.value} | {g.weight:g} | {share} | {g.restarts} | "
                         f"{g.drill_rebuilds} | {members} | {_cell(g.message)} |")
    if status.canary is not None:
        c = status.canary
        what = c.decision or f"step {c.step} at {c.percent:g} %"
        lines += ["", f"latest canary: {c.canary} over {c.stable}: **{what}** {_cell(c.reason)}"]
    if status.lease is not None:
        lines += ["", f"changing the fleet now: {status.lease.purpose} ({status.lease.holder}, "
                      f"for {time.time() - status.lease.acquired_at:.0f}s)"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]
