"""Fault drills: under load, kill a member (SIGKILL, or a pod deleted at once) and prove the group is rebuilt.

Each repeat: open-loop load runs against the router; the controller kills one member of the chosen
role (the drill needs no pid or process of its own, so it runs from any flow process); we measure
how long until the router stops sending to the group (ejection) and until the controller has the
group Ready again with every member new. Every request is accounted for: sent == ok + error, each
error with its reason.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Literal

from pydantic import BaseModel, Field

from engine.drills.load import run_load_drill_async
from engine.drills.results import LoadDrillReport
from engine.drills.spec import LoadDrillSpec
from engine.control.client import ControlAPIError, ControlClient
from engine.errors import TideflowError
from engine.group.manager import GroupState

Target = Literal["prefill", "decode", "colocated", "encoder", "expert"]


class FaultDrillError(TideflowError):
    """The drill could not run (no such group or member) or the group did not recover."""


class FaultDrillSpec(BaseModel):
    group: str = Field(description="name of the group to hit")
    target: Target = Field("decode", description="role of the member to kill; 'expert' = a non-leader DEP rank")
    repeats: int = Field(1, ge=1, le=20, description="kill, recover, repeat")
    kill_after_s: float = Field(1.0, ge=0, description="seconds of load before the kill")
    load: LoadDrillSpec = Field(description="background load (its url/model point at the router)")
    recovery_timeout_s: float = Field(180.0, gt=0, description="the group must be Ready again within this")


class FaultRun(BaseModel):
    repeat: int
    killed: str = Field(description="role/instance/rank of the killed member and what it was (pid N or pod NAME UID)")
    eject_s: float | None = Field(description="kill -> the router no longer routes to the group")
    recover_s: float | None = Field(description="kill -> the group is rebuilt: Ready again, or Standby in the pool "
                                                "when a warm standby took its place")
    all_members_new: bool
    load: LoadDrillReport


class FaultDrillReport(BaseModel):
    group: str
    target: Target
    runs: list[FaultRun]
    sent: int
    ok: int
    errors: int
    error_reasons: dict[str, int]

    @property
    def accounted(self) -> bool:
        """Every issued request ended ok or with an error (`sent` is the load generator's own count)."""
        return self.sent == self.ok + self.errors and all(r.load.accounted for r in self.runs)


def run_fault_drill(client: ControlClient, spec: FaultDrillSpec,
                    progress: Callable[[str], None] | None = None) -> FaultDrillReport:
    say = progress or (lambda _m: None)
    try:
        client.group(spec.group)
    except ControlAPIError as exc:
        raise FaultDrillError(f"no group {spec.group!r} in the fleet: {exc}") from None
    runs = []
    for repeat in range(spec.repeats):
        view = client.wait_for(spec.group, {GroupState.READY, GroupState.FAILED}, spec.recovery_timeout_s)
        if view.state != GroupState.READY:
            raise FaultDrillError(f"group {spec.group} is {view.state.value}, not Ready: cannot drill")
        runs.append(asyncio.run(_one(client, spec, repeat)))
        r = runs[-1]
        say(f"repeat {repeat}: killed {r.killed}; ejected in {_ms(r.eject_s)}, Ready again in {_s(r.recover_s)}, "
            f"{r.load.ok}/{r.load.sent} ok")
    reasons: dict[str, int] = {}
    for r in runs:
        for step in r.load.steps:
            for why, n in step.error_reasons.items():
                reasons[why] = reasons.get(why, 0) + n
    return FaultDrillReport(group=spec.group, target=spec.target, runs=runs,
                            sent=sum(r.load.sent for r in runs), ok=sum(r.load.ok for r in runs),
                            errors=sum(r.load.error for r in runs), error_reasons=reasons)


async def _one(client: ControlClient, spec: FaultDrillSpec, repeat: int) -> FaultRun:
    view = client.group(spec.group)
    if not any(m.role == spec.target or (spec.target == "expert" and m.rank > 0) for m in view.members):
        raise FaultDrillError(f"the group has no {spec.target} member to kill")
    load = asyncio.create_task(run_load_drill_async(spec.load.model_copy(update={"seed": spec.load.seed + repeat})))
    await asyncio.sleep(spec.kill_after_s)
    try:
        killed = await asyncio.to_thread(client.kill, spec.group, spec.target)
    except ControlAPIError as exc:
        load.cancel()
        raise FaultDrillError(f"could not kill a {spec.target} member of {spec.group}: {exc}") from None
    t_kill = time.monotonic()
    if not killed.landed:
        load.cancel()
        raise FaultDrillError(f"the kill of {killed.member} ({killed.id}) did not land: it is still running")
    eject_s = await _until(lambda: not _routable(client, spec.group), spec.recovery_timeout_s, t_kill)
    recover_s = await _until(lambda: _rebuilt(client, spec.group, killed.before), spec.recovery_timeout_s, t_kill)
    report = await load
    after = {m.id for m in client.group(spec.group).members if m.id} if recover_s is not None else set()
    return FaultRun(repeat=repeat, killed=f"{killed.member} ({killed.id})", eject_s=eject_s, recover_s=recover_s,
                    all_members_new=bool(after) and after.isdisjoint(killed.before), load=report)


def _routable(client: ControlClient, name: str) -> bool:
    return any(g["name"] == name and g["routable"] for g in client.groups())


def _rebuilt(client: ControlClient, name: str, before: list[str]) -> bool:
    """Rebuilt and back: Ready (or Standby, when a warm standby took its place and it was rebuilt into the
    pool) with at least one member that is not one of the killed build's (a process or pod of its own)."""
    view = client.group(name)
    now = {m.id for m in view.members if m.id}
    return view.state in (GroupState.READY, GroupState.STANDBY) and bool(now) and not now <= set(before)


async def _until(condition, timeout_s: float, since: float) -> float | None:
    while time.monotonic() - since < timeout_s:
        if await asyncio.to_thread(condition):
            return time.monotonic() - since
        await asyncio.sleep(0.01)
    return None


def _ms(v: float | None) -> str:
    return "never" if v is None else f"{v * 1000:.0f} ms"


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f}s"
