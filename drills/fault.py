"""Fault drills: under load, kill a member (SIGKILL, or a pod deleted at once), the router or the controller,
and prove nothing was lost.

Each repeat: open-loop greedy load runs against the router; the controller kills one member of the
chosen role (the drill needs no pid or process of its own, so it runs from any flow process) and
confirms the kill landed; we measure how long until the router stops sending to the group (ejection)
and until the group is rebuilt with every member new. A router kill (by the controller, which starts
a new router) or a controller kill (drills.plane) must leave every member as it was. Every request is accounted for (sent == ok +
error, sent counted by the load generator itself); the streams open at the kill are checked: their
longest pause, how many the router migrated (its own counter), and, replayed undisturbed afterwards,
token for token (text chunks, one per token) against what the client got: lost and duplicated tokens.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import threading
import time
from datetime import datetime
from typing import Callable, Literal

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from drills.load import replay, run_load_drill_async
from drills.plane import PlaneFaultError, kill_controller, restart_controller, router_answers
from drills.results import LoadDrillReport
from drills.spec import LoadDrillSpec
from engine.control.client import ControlAPIError, ControlClient
from engine.runtime.errors import TideflowError
from engine.group.manager import GroupState
from engine.runtime.http import bearer_client

Target = Literal["prefill", "decode", "colocated", "encoder", "expert", "router", "controller"]
PLANE = ("router", "controller")  # the rest are members of the group


class FaultDrillError(TideflowError):
    """The drill could not run (no such group or member) or the group did not recover."""


class FaultDrillSpec(BaseModel):
    group: str = Field(description="name of the group to hit")
    target: Target = Field("decode", description="role of the member to kill ('expert' = a non-leader DEP rank), "
                                                 "or the router or the controller (the group must keep its members)")
    repeats: int = Field(1, ge=1, le=20, description="kill, recover, repeat")
    kill_after_s: float = Field(1.0, ge=0, description="seconds of load before the kill, from the first request sent")
    load: LoadDrillSpec = Field(description="background load (its url/model point at the router); sent greedy, "
                                            "so every answer can be replayed and compared")
    recovery_timeout_s: float = Field(180.0, gt=0, description="the group must be Ready again within this")


class FaultRun(BaseModel):
    repeat: int
    killed: str = Field(description="role/instance/rank of the killed member and what it was (pid N or pod NAME UID)")
    eject_s: float | None = Field(description="kill -> the router no longer routes to the group")
    recover_s: float | None = Field(description="kill -> back to full capacity: the group rebuilt (Ready again, or "
                                                "Standby in the pool when a warm standby took its place), or the "
                                                "router / controller answering again with the group Ready")
    all_members_new: bool
    members_as_expected: bool = Field(description="a member kill: every member new (rebuilt whole); a router or "
                                                  "controller kill: every member the same (kept, adopted)")
    kill_at_s: float = Field(description="when the kill landed, in seconds from the start of the load")
    open_at_kill: int = Field(description="requests sent before the kill that ended after it")
    failed_after_kill: int = Field(0, description="requests sent after the kill that failed: what a kill costs clients "
                                                  "that had nothing in flight (0 when the router kept serving)")
    migrated: int = Field(description="requests the router moved to another worker (its migrations counter)")
    stream_gap_p50_ms: float | None = Field(description="median, over the streams open at the kill, of each one's "
                                                        "longest pause between two chunks")
    stream_gap_p99_ms: float | None = Field(description="p99 of the same")
    checked: int = Field(description="answers of streams open at the kill replayed and compared, token by token")
    lost_tokens: int = Field(description="tokens of the undisturbed answer missing from what the client got")
    duplicated_tokens: int = Field(description="tokens the client got that the undisturbed answer does not have")
    unchecked: int = Field(description="open-at-kill answers whose replay failed (cannot be compared)")
    load: LoadDrillReport


class FaultDrillReport(BaseModel):
    group: str
    target: Target
    runs: list[FaultRun]
    sent: int
    ok: int
    errors: int
    error_reasons: dict[str, int]
    migrated: int = 0
    lost_tokens: int = 0
    duplicated_tokens: int = 0

    @property
    def accounted(self) -> bool:
        """Every issued request ended ok or with an error (`sent` is the load generator's own count)."""
        return self.sent == self.ok + self.errors and all(r.load.accounted for r in self.runs)

    @property
    def clean(self) -> bool:
        """Nothing lost: every request accounted for and ok, every checked answer exact, every replay checked,
        and the group rebuilt whole each time."""
        return (self.accounted and self.errors == 0 and self.lost_tokens == 0 and self.duplicated_tokens == 0
                and all(r.unchecked == 0 and r.recover_s is not None and r.members_as_expected for r in self.runs))

    def table(self) -> list[dict]:
        """One row per repeat, as the CLI prints it and the flow shows it."""
        return [{"repeat": r.repeat, "killed": r.killed, "eject_ms": _round(r.eject_s, 1000),
                 "recover_s": _round(r.recover_s, 1), "sent": r.load.sent, "ok": r.load.ok, "error": r.load.error,
                 "open_at_kill": r.open_at_kill, "migrated": r.migrated, "gap_p50_ms": _round(r.stream_gap_p50_ms, 1),
                 "gap_p99_ms": _round(r.stream_gap_p99_ms, 1), "checked": r.checked, "lost_tokens": r.lost_tokens,
                 "dup_tokens": r.duplicated_tokens} for r in self.runs]


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
                            errors=sum(r.load.error for r in runs), error_reasons=reasons,
                            migrated=sum(r.migrated for r in runs), lost_tokens=sum(r.lost_tokens for r in runs),
                            duplicated_tokens=sum(r.duplicated_tokens for r in runs))


async def _one(client: ControlClient, spec: FaultDrillSpec, repeat: int) -> FaultRun:
    view = client.group(spec.group)
    if spec.target not in PLANE and not any(m.role == spec.target or (spec.target == "expert" and m.rank > 0)
                                            for m in view.members):
        raise FaultDrillError(f"the group has no {spec.target} member to kill")
    ids_before = {m.id for m in view.members if m.id}
    status = client.status()
    router_url, routers_before = status.router_url, len(status.router_pids)
    load_spec = spec.load.model_copy(update={"seed": spec.load.seed + repeat, "temperature": 0.0})
    routers = status.replica_urls() if load_spec.base_url.removesuffix("/v1") == router_url else [
        load_spec.base_url.removesuffix("/v1")]  # this fleet's router: every replica, where it alone answers
    migrated_before = await asyncio.to_thread(_migrations, load_spec, routers)
    flowing = threading.Event()
    load = asyncio.create_task(run_load_drill_async(load_spec, flowing=flowing))
    while not flowing.is_set() and not load.done():  # the schedule is built first: time the kill from the first send
        await asyncio.sleep(0.01)
    await asyncio.sleep(spec.kill_after_s)
    try:
        killed, landed, before, restart = await asyncio.to_thread(_kill, client, spec)
    except (ControlAPIError, PlaneFaultError) as exc:
        load.cancel()
        raise FaultDrillError(f"could not kill the {spec.target} of {spec.group}: {exc}") from None
    t_kill, wall_kill = time.monotonic(), time.time()
    if not landed:
        load.cancel()
        raise FaultDrillError(f"the kill of {killed} did not land: it is still running")
    if restart is not None:
        restart()
    if spec.target in PLANE:
        eject_s = None
        recover_s = await _until(lambda: _plane_back(client, spec.group, router_url, ids_before, routers_before),
                                 spec.recovery_timeout_s, t_kill)
    else:
        eject_s = await _until(lambda: not _routable(client, spec.group), spec.recovery_timeout_s, t_kill)
        recover_s = await _until(lambda: _rebuilt(client, spec.group, before), spec.recovery_timeout_s, t_kill)
    report = await load
    if routers != [router_url]:
        try:
            routers = client.status().replica_urls()  # a replica started again since: a new port of its own
        except ControlAPIError:
            pass  # the controller is not back: the replicas it listed before
    migrated_after = await asyncio.to_thread(_migrations, load_spec, routers)
    migrated = sum(max(0.0, n - migrated_before.get(url, 0.0)) for url, n in migrated_after.items())
    after = {m.id for m in client.group(spec.group).members if m.id} if recover_s is not None else set()
    all_new = bool(after) and after.isdisjoint(before or ids_before)
    kill_s = wall_kill - datetime.fromisoformat(report.started_at).timestamp()
    at_risk = [r for r in report.requests if r.sent_s <= kill_s <= r.end_s]
    gaps = [r.max_gap_ms for r in at_risk if r.max_gap_ms is not None]
    answered = [r for r in at_risk if r.ok]
    references = await replay(load_spec, answered)
    lost = duplicated = unchecked = 0
    for rec, reference in zip(answered, references):
        if reference is None:
            unchecked += 1
            continue
        missing, extra = token_diff(reference, rec.chunks)
        lost, duplicated = lost + missing, duplicated + extra
    return FaultRun(repeat=repeat, killed=killed, eject_s=eject_s, recover_s=recover_s, all_members_new=all_new,
                    members_as_expected=(after == ids_before) if spec.target in PLANE else all_new, kill_at_s=kill_s,
                    open_at_kill=len(at_risk),
                    failed_after_kill=sum(not r.ok for r in report.requests if r.sent_s > kill_s), migrated=round(migrated), stream_gap_p50_ms=_pct(gaps, 50),
                    stream_gap_p99_ms=_pct(gaps, 99), checked=len(answered) - unchecked, lost_tokens=lost,
                    duplicated_tokens=duplicated, unchecked=unchecked, load=report)


def _kill(client: ControlClient, spec: FaultDrillSpec):
    """(what was killed, seen gone, member ids a rebuild must not have, restart to run once it is gone)."""
    if spec.target == "controller":
        what, landed, argv = kill_controller()
        return f"controller ({what})", landed, [], lambda: restart_controller(argv)
    if spec.target == "router":
        hit = client.kill_router()
        return f"router ({hit.id})", hit.landed, [], None
    hit = client.kill(spec.group, spec.target)
    return f"{hit.member} ({hit.id})", hit.landed, hit.before, None


def _plane_back(client: ControlClient, name: str, router_url: str, members: set[str], routers: int) -> bool:
    """The router answers with the group routable, the controller answers with as many router replicas as before
    the kill, each reporting that it serves the route set, and the group is Ready with its members."""
    if not router_answers(router_url) or not client.health():
        return False
    try:
        view, status = client.group(name), client.status()
    except ControlAPIError:
        return False
    return (view.state == GroupState.READY and {m.id for m in view.members if m.id} == members
            and len(status.router_pids) >= routers
            and all(any(f"/{pid}/" in r["replica"] for r in status.router_replicas) for pid in status.router_pids))


def token_diff(reference: list[str], got: list[str]) -> tuple[int, int]:
    """(lost, duplicated): chunks of the undisturbed answer the client lacks, and chunks it got in excess."""
    lost = duplicated = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=reference, b=got, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            duplicated += j2 - j1
    return lost, duplicated


def _migrations(load: LoadDrillSpec, routers: list[str]) -> dict[str, float]:
    """Each router replica's tideflow_router_migrations_total, all groups and reasons (0 before any); a replica
    that does not answer (killed by the drill) is left out."""
    key = os.environ.get(load.api_key_env, "") if load.api_key_env else None
    out = {}
    with bearer_client(key or None, timeout_s=10.0) as http:
        for url in routers:
            try:
                text = http.get(url + "/metrics").raise_for_status().text
            except httpx.TransportError:
                continue
            out[url] = sum(s.value for family in text_string_to_metric_families(text)
                           if family.name == "tideflow_router_migrations" for s in family.samples
                           if s.name.endswith("_total"))
    return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _round(v: float | None, scale: float) -> float | None:
    return None if v is None else round(v * scale, 1)


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
