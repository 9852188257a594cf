"""LocalProcessBackend: every member is an OS process on this machine, on loopback ports."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from pydantic import BaseModel, Field

from engine.group.argv import serve_argv
from engine.group.backend import Backend, BackendError, GroupHandle, MemberIdentity, MemberStatus, Phase
from engine.core import host_memory
from engine.group.capacity import CapacityCheck, MemoryShortage, check_fits, held_bytes, member_need
from engine.group.gpus import VISIBLE_ENV, GpuPool, GpuShortage
from engine.group.spec import InferenceGroup, Member, Role
from engine.api.auth import API_KEY_FILE_ENV
from engine.runtime.http import Key, bearer_client
from engine.runtime.paths import home
from engine.runtime.process import Adopted, Child, adopt, free_port, tideflow_argv
from engine.runtime.tls import TlsIdentity, is_loopback


class MemberRecord(BaseModel):
    """One member process as started: enough to find it again (and be sure it is the same one) after a restart."""

    handle_id: str
    group: str
    role: Role
    instance: int = Field(ge=0)
    rank: int = Field(ge=0)
    size: int = Field(ge=1)
    port: int = Field(ge=1, le=65535)
    pid: int = Field(ge=1)
    ticks: int = Field(ge=0, description="kernel start time of pid (clock ticks since boot)")
    log_path: str
    gpus: list[str] = Field(default_factory=list, description="the host GPUs the member owns (CUDA_VISIBLE_DEVICES)")


class ProcessLedger(Protocol):
    """Durable record of every member process the backend runs (the controller's SQLite store)."""

    def record(self, rec: MemberRecord) -> None: ...

    def forget(self, handle_id: str) -> None: ...


@dataclass
class _Running:
    group: InferenceGroup
    handle: GroupHandle
    children: dict[Member, Child | Adopted] = field(default_factory=dict)
    ports: dict[Member, int] = field(default_factory=dict)
    gpus: dict[Member, list[str]] = field(default_factory=dict)
    estimates: dict[Member, int] = field(default_factory=dict)  # host memory each will hold (capacity check), bytes


def _member_name(handle_id: str, role: str, instance: int, rank: int) -> str:
    """A member's process name: its log file's name and the owner of its GPUs."""
    return f"{handle_id}-{role}{instance}r{rank}"


class LocalProcessBackend(Backend):
    """Starts `tideflow serve` once per member; a DEP instance's ranks rendezvous on a local port."""

    name = "local"

    def __init__(self, model_dir: Path, api_key: Key, model_name: str = "default", log_dir: Path | None = None,
                 host: str = "127.0.0.1", extra_env: dict[str, str] | None = None,
                 ledger: ProcessLedger | None = None, gpus: GpuPool | None = None,
                 capacity: CapacityCheck | None = None, key_file: Path | None = None,
                 identity: TlsIdentity | None = None) -> None:
        """`api_key`: what this backend sends to members (a callable: the current key of a rotating one);
        `key_file`: the key file members verify, read again when it changes (engine.control.keys writes it),
        else members accept `api_key` as started. `identity`: the members' certificate (mutual TLS with
        the fleet's CA; None: plain HTTP)."""
        self.model_dir, self.api_key, self.model_name, self.host = model_dir, api_key, model_name, host
        self.key_file = key_file
        self.log_dir = log_dir or home() / "logs"
        self.extra_env = {**(extra_env or {}), **(identity.env() if identity else {})}
        self.scheme = "https" if identity else "http"
        self.ledger = ledger
        self.gpus = gpus or GpuPool()
        self.capacity = capacity or CapacityCheck()
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()

    def start(self, group: InferenceGroup, standby: bool = False) -> GroupHandle:
        handle = GroupHandle(id=f"{group.name}-{uuid.uuid4().hex[:6]}", group=group.name, version=group.version,
                             backend=self.name, standby=standby)
        run = _Running(group, handle)
        instances = [(spec.role, instance) for spec in group.roles for instance in range(spec.instances)]
        with self._lock:  # checked and reserved together: two groups starting at once cannot both take the last GiB
            try:
                self._reserve_memory(run, instances)
            except MemoryShortage as exc:
                raise BackendError(f"could not start group {group.name}: it {exc}") from None
            self._running[handle.id] = run
        try:
            for role, instance in instances:
                self._start_instance(run, role, instance)
        except GpuShortage as exc:
            self.delete(handle)
            raise BackendError(f"could not start group {group.name}: it {exc}") from None
        except OSError as exc:
            self.delete(handle)
            raise BackendError(f"could not start group {group.name}: {exc}") from None
        except BaseException:
            self.delete(handle)  # whatever failed after a spawn, no member of a half-started group stays behind
            raise
        return handle

    def _reserve_memory(self, run: _Running, instances: list[tuple[Role, int]]) -> None:
        """Estimate what the members of `instances` will hold and keep it in `run.estimates`, or raise
        MemoryShortage when they do not fit beside the members running (caller holds the lock)."""
        if not self.capacity.enabled or not instances:
            return
        mem_available = host_memory.available_bytes()  # what a member sizes a kv_cache_fraction by
        available = self.capacity.mem_available_bytes or mem_available
        model = self.model_path(run.group)
        needs = {role: member_need(run.group, run.group.role(role), model, mem_available) for role, _ in instances}
        new = {}
        for role, instance in instances:
            size = run.group.role(role).members_per_instance
            new |= {Member(role=role, instance=instance, rank=rank, size=size): needs[role] for rank in range(size)}
        check_fits(new, self._taken(), available, self.capacity)
        run.estimates.update({member: need.total for member, need in new.items()})

    def _taken(self) -> int:
        """Bytes of the available memory that the members this backend runs take (caller holds the lock).

        Each will hold the larger of its anonymous memory now (/proc) and its estimate: the estimate while it
        loads or before it is spawned. MemAvailable already leaves out what they hold now, so against it only
        the rest counts; a configured figure is a budget they take in full.
        """
        budget = self.capacity.mem_available_bytes is not None
        runs = [(dict(r.children), dict(r.estimates)) for r in self._running.values()]  # scale() edits them meanwhile
        held = held_bytes({c.pid for children, _ in runs for c in children.values() if c.alive()})
        taken = 0
        for children, estimates in runs:
            for member in children.keys() | estimates.keys():
                child = children.get(member)
                if child is not None and not child.alive():
                    continue  # exited: holds nothing
                now = held.get(child.pid, 0) if child is not None else 0
                will = max(now, estimates.get(member, 0))
                taken += will if budget else will - now
        return taken

    def _start_instance(self, run: _Running, role: Role, instance: int) -> None:
        spec = run.group.role(role)
        size = spec.members_per_instance
        dist_port = free_port(self.host) if size > 1 else None
        names = [_member_name(run.handle.id, role, instance, rank) for rank in range(size)]
        owned = self.gpus.take({name: spec.resources.gpus for name in names})  # the instance's GPUs, or none of it
        for rank, name in enumerate(names):
            member = Member(role=role, instance=instance, rank=rank, size=size)
            port = (spec.port_base + instance * size + rank) if spec.port_base else free_port(self.host)
            argv = tideflow_argv(*self.member_args(run.group, member, port, dist_port, run.handle.standby))
            # the members' key is the router's (and the controller's): it forwards, naming the client it serves
            env = {API_KEY_FILE_ENV: str(self.key_file)} if self.key_file is not None else \
                {"TIDEFLOW_API_KEYS": f"{self.api_key} forwards"}
            env.update(self.extra_env)
            if owned[name]:
                env[VISIBLE_ENV] = ",".join(owned[name])
            run.gpus[member] = owned[name]
            child = run.children[member] = Child(name, argv, self.log_dir / f"{name}.log", env)
            run.ports[member] = port
            if self.ledger is not None:
                self.ledger.record(MemberRecord(
                    handle_id=run.handle.id, group=run.group.name, role=role, instance=instance, rank=rank, size=size,
                    port=port, pid=child.pid, ticks=child.start_ticks, log_path=str(child.log_path), gpus=owned[name]))

    def adopt(self, group: InferenceGroup, records: list[MemberRecord], standby: bool) -> GroupHandle:
        """Take over a group an earlier controller started, every member still the same process.

        All or nothing: when one member is gone (or its pid now names another process), the members that
        are left are stopped and BackendError says which one failed; the caller rebuilds the group whole.
        """
        if not records:
            raise BackendError(f"no recorded members of group {group.name}")
        handle = GroupHandle(id=records[0].handle_id, group=group.name, version=group.version, backend=self.name,
                             standby=standby)
        run = _Running(group, handle)
        missing = []
        for rec in records:
            member = Member(role=rec.role, instance=rec.instance, rank=rec.rank, size=rec.size)
            name = _member_name(rec.handle_id, rec.role, rec.instance, rec.rank)
            proc = adopt(name, rec.pid, rec.ticks, Path(rec.log_path))
            if proc is None:
                missing.append(f"{rec.role}/{rec.instance}/{rec.rank} pid {rec.pid}")
                continue
            run.children[member], run.ports[member], run.gpus[member] = proc, rec.port, rec.gpus
            self.gpus.hold(name, rec.gpus)
        if missing or len(run.children) != group.total_members:
            for proc in run.children.values():
                proc.stop(grace_s=2.0)
            self._give_back_gpus(run, run.children)
            if self.ledger is not None:
                self.ledger.forget(handle.id)
            raise BackendError(f"group {group.name} cannot be adopted: gone {missing or 'members'}")
        with self._lock:
            self._running[handle.id] = run
        return handle

    def model_path(self, group: InferenceGroup) -> str:
        """The group's own checkpoint (versions differ by weights), else the set's."""
        return group.model.expanded_path() if group.model.path else str(self.model_dir)

    def member_args(self, group: InferenceGroup, member: Member, port: int, dist_port: int | None, standby: bool) -> list[str]:
        argv = serve_argv(group, group.role(member.role), model=self.model_path(group), host=self.host, port=port,
                          served_name=self.model_name, rank=member.rank, standby=standby,
                          dist_addr=f"{self.host}:{dist_port}" if member.size > 1 else None)
        if self.scheme == "http" and not is_loopback(self.host):
            argv.append("--plain-http")  # the controller was told TLS off: members off loopback say so too
        return argv

    def _run(self, handle: GroupHandle) -> _Running:
        with self._lock:
            run = self._running.get(handle.id)
        if run is None:
            raise BackendError(f"no running group {handle.id} on the local backend")
        return run

    def endpoint(self, handle: GroupHandle, member: Member) -> str:
        return f"{self.scheme}://{self.host}:{self._run(handle).ports[member]}"

    def members(self, handle: GroupHandle) -> list[MemberStatus]:
        run = self._run(handle)
        out = []
        with bearer_client(self.api_key) as client:
            for member, child in sorted(run.children.items(), key=lambda kv: (kv[0].role, kv[0].instance, kv[0].rank)):
                out.append(self._observe(client, run, member, child))
        return out

    def _observe(self, client: httpx.Client, run: _Running, member: Member, child: Child) -> MemberStatus:
        url = f"{self.scheme}://{self.host}:{run.ports[member]}"
        base = dict(role=member.role, instance=member.instance, rank=member.rank, endpoint=url)
        code = child.returncode
        if code is not None:
            phase = Phase.EXITED if code == 0 else Phase.FAILED
            return MemberStatus(**base, phase=phase, message=f"exit code {code}: {child.log_tail(3)}", exit_code=code)
        try:
            ready = client.get(url + "/ready", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            ready = False
        return MemberStatus(**base, phase=Phase.READY if ready else Phase.RUNNING)

    def wait_ready(self, handle: GroupHandle, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            phases = {m.phase for m in self.members(handle)}
            if phases == {Phase.READY}:
                return True
            if phases & {Phase.FAILED, Phase.EXITED}:
                return False
            time.sleep(0.1)
        return False

    def pids(self, handle: GroupHandle) -> dict[Member, int]:
        """Process ids per member."""
        return {m: c.pid for m, c in self._run(handle).children.items()}

    def identities(self, handle: GroupHandle) -> list[MemberIdentity]:
        return sorted((MemberIdentity(role=m.role, instance=m.instance, rank=m.rank, id=f"pid {pid}", pid=pid)
                       for m, pid in self.pids(handle).items()), key=lambda i: (i.role, i.instance, i.rank))

    def stop(self, handle: GroupHandle, drain_s: float) -> None:
        run = self._run(handle)
        for child in run.children.values():
            child.stop(grace_s=max(drain_s, 1.0))

    def scale(self, group_name: str, role: Role, instances: int) -> None:
        with self._lock:
            runs = [r for r in self._running.values() if r.group.name == group_name]
        if not runs:
            raise BackendError(f"no running group named {group_name}")
        run = runs[-1]
        current = 1 + max((m.instance for m in run.children if m.role == role), default=-1)
        with self._lock:
            try:
                self._reserve_memory(run, [(role, instance) for instance in range(current, instances)])
            except MemoryShortage as exc:
                raise BackendError(f"could not scale {group_name}/{role} to {instances} instances: it {exc}") from None
        try:
            for instance in range(current, instances):
                self._start_instance(run, role, instance)
        except GpuShortage as exc:
            raise BackendError(f"could not scale {group_name}/{role} to {instances} instances: it {exc}") from None
        finally:  # however it failed, what never started reserves no memory
            run.estimates = {m: e for m, e in run.estimates.items() if m in run.children}
        gone = [m for m in run.children if m.role == role and m.instance >= instances]
        for member in gone:
            run.children.pop(member).stop()
            run.ports.pop(member)
            run.estimates.pop(member, None)
        self._give_back_gpus(run, gone)

    def delete(self, handle: GroupHandle) -> None:
        with self._lock:
            run = self._running.pop(handle.id, None)
        if run is not None:
            for child in run.children.values():
                child.stop(grace_s=2.0)
            self._give_back_gpus(run, list(run.children))
        if self.ledger is not None:
            self.ledger.forget(handle.id)

    def _give_back_gpus(self, run: _Running, members) -> None:
        """Free the GPUs of stopped members (a member that never owned any frees nothing)."""
        self.gpus.give_back({_member_name(run.handle.id, m.role, m.instance, m.rank) for m in members})
        for m in list(members):
            run.gpus.pop(m, None)

    def kill(self, handle: GroupHandle, member: MemberIdentity, confirm_s: float = 10.0) -> bool:
        """SIGKILL the member's process."""
        children = self._run(handle).children
        child = next((c for m, c in children.items() if (m.role, m.instance, m.rank) == (member.role, member.instance,
                                                                                            member.rank)), None)
        if child is None or child.pid != member.pid:
            raise BackendError(f"group {handle.group} has no member {member.id} now")
        child.kill()
        deadline = time.monotonic() + confirm_s
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not child.alive()
