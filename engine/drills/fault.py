"""Fault drills: under load, kill a member (SIGKILL) and prove the group is rebuilt whole.

Each repeat: open-loop load runs against the router; one member of the chosen role is killed;
we measure how long until the router stops sending to the group (ejection) and until the
manager has the group Ready again with every member new. Every request is accounted for:
sent == ok + error, each error with its reason.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Callable, Literal

from pydantic import BaseModel, Field

from engine.drills.load import run_load_drill_async
from engine.drills.results import LoadDrillReport
from engine.drills.spec import LoadDrillSpec
from engine.errors import TideflowError
from engine.group.groupset import LocalGroupSet
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
    killed: str = Field(description="role/instance/rank and pid of the killed member")
    eject_s: float | None = Field(description="kill -> the router no longer routes to the group")
    recover_s: float | None = Field(description="kill -> the group is Ready again")
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
        return self.sent == self.ok + self.errors


def run_fault_drill(groupset: LocalGroupSet, spec: FaultDrillSpec,
                    progress: Callable[[str], None] | None = None) -> FaultDrillReport:
    say = progress or (lambda _m: None)
    managed = groupset.manager.groups.get(spec.group)
    if managed is None:
        raise FaultDrillError(f"no group {spec.group!r} in this group set")
    runs = []
    for repeat in range(spec.repeats):
        if managed.wait_for({GroupState.READY}, spec.recovery_timeout_s) != GroupState.READY:
            raise FaultDrillError(f"group {spec.group} is {managed.status.state.value}, not Ready: cannot drill")
        runs.append(asyncio.run(_one(groupset, managed, spec, repeat)))
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


def _victim(groupset: LocalGroupSet, handle, target: Target) -> tuple[str, int, set[int]]:
    pids = groupset.backend.pids(handle)
    if target == "expert":
        candidates = [(m, p) for m, p in pids.items() if m.size > 1 and m.rank > 0]
    else:
        candidates = [(m, p) for m, p in pids.items() if m.role == target]
    if not candidates:
        raise FaultDrillError(f"the group has no {target} member to kill")
    member, pid = sorted(candidates, key=lambda mp: (mp[0].instance, mp[0].rank))[0]
    return f"{member.role}/{member.instance}/{member.rank} pid {pid}", pid, set(pids.values())


async def _one(groupset: LocalGroupSet, managed, spec: FaultDrillSpec, repeat: int) -> FaultRun:
    handle = managed.status.handle
    killed, pid, before = _victim(groupset, handle, spec.target)
    load = asyncio.create_task(run_load_drill_async(spec.load.model_copy(update={"seed": spec.load.seed + repeat})))
    await asyncio.sleep(spec.kill_after_s)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    eject_s = await _until(lambda: not _routable(groupset, spec.group), spec.recovery_timeout_s, t_kill)
    recover_s = await _until(lambda: managed.status.state == GroupState.READY and managed.status.handle != handle,
                             spec.recovery_timeout_s, t_kill)
    report = await load
    after = set(groupset.backend.pids(managed.status.handle).values()) if recover_s is not None else set()
    return FaultRun(repeat=repeat, killed=killed, eject_s=eject_s, recover_s=recover_s,
                    all_members_new=bool(after) and after.isdisjoint(before), load=report)


def _routable(groupset: LocalGroupSet, name: str) -> bool:
    return any(g["name"] == name and g["routable"] for g in groupset.admin.groups())


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
