"""An in-process controller over a backend that runs nothing: the controller's own code (reconcile, verbs,
supervision, replacement, autoscalers) with every member a line in a table the test flips. Races between
the controller's threads are made to happen on purpose here, which real processes cannot do on cue; the
end-to-end behaviour over real processes is tested in test_controller.py and test_warm_replacement.py."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from engine.control.controller import Controller
from engine.control.runtime import ControllerConfig, Runtime
from engine.control.store import Store
from engine.group.backend import Backend, BackendError, GroupHandle, MemberIdentity, MemberStatus, Phase
from engine.group.manager import GroupManager, SupervisionPolicy
from engine.group.spec import InferenceGroup

POLICY = SupervisionPolicy(ready_timeout_s=30, max_restarts=3, backoff_s=0.01, backoff_max_s=0.05, poll_s=0.01)


def group_spec(name: str, version: str = "v1") -> InferenceGroup:
    return InferenceGroup.model_validate({"name": name, "version": version, "model": {"path": "unused"},
                                          "roles": [{"role": "colocated"}]})


class TableBackend(Backend):
    """Each started group has one member, Ready at once; a test fails it (`fall`), breaks observation of it
    (`blind`) or refuses to start it (`refuse`)."""

    name = "table"

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.phase: dict[str, Phase] = {}  # handle id -> its member's phase
        self.group_of: dict[str, str] = {}  # handle id -> group name
        self.blind: set[str] = set()  # group names whose observation raises BackendError
        self.refuse: dict[str, int] = {}  # group name -> starts still to refuse
        self.started: list[str] = []  # group names, one per start
        self.deleted: list[str] = []  # handle ids

    def start(self, group: InferenceGroup, standby: bool = False) -> GroupHandle:
        with self._lock:
            if self.refuse.get(group.name, 0) > 0:
                self.refuse[group.name] -= 1
                raise BackendError(f"{group.name}: the substrate refused the start")
            handle = GroupHandle(id=f"h{next(self._ids)}", group=group.name, version=group.version,
                                 backend=self.name, standby=standby)
            self.phase[handle.id] = Phase.READY
            self.group_of[handle.id] = group.name
            self.started.append(group.name)
            return handle

    def members(self, handle: GroupHandle) -> list[MemberStatus]:
        if handle.group in self.blind:
            raise BackendError(f"{handle.group}: the substrate's API does not answer")
        with self._lock:
            phase = self.phase.get(handle.id, Phase.EXITED)
        return [MemberStatus(role="colocated", instance=0, rank=0, endpoint=f"http://127.0.0.1:{10000 + int(handle.id[1:])}",
                             phase=phase, exit_code=None if phase == Phase.READY else 1)]

    def fall(self, group: str) -> None:
        """The member of the group's newest build fails."""
        with self._lock:
            newest = max((h for h, p in self.phase.items() if p == Phase.READY and self.group_of[h] == group),
                         key=lambda h: int(h[1:]))
            self.phase[newest] = Phase.FAILED

    def wait_ready(self, handle: GroupHandle, timeout_s: float) -> bool:
        return True

    def stop(self, handle: GroupHandle, drain_s: float) -> None:
        self.delete(handle)

    def scale(self, group_name, role, instances) -> None:
        raise BackendError("not supported here")

    def delete(self, handle: GroupHandle) -> None:
        with self._lock:
            self.phase[handle.id] = Phase.EXITED
            self.deleted.append(handle.id)

    def identities(self, handle: GroupHandle) -> list[MemberIdentity]:
        return [MemberIdentity(role="colocated", instance=0, rank=0, id=f"fake {handle.id}")]

    def kill(self, handle: GroupHandle, member: MemberIdentity, confirm_s: float = 10.0) -> bool:
        with self._lock:
            self.phase[handle.id] = Phase.FAILED
        return True


class QuietSwitch:
    """Members that switch between serving and standby at once (no HTTP: nothing listens)."""

    def activate(self, urls: list[str]) -> None:
        pass

    def park(self, urls: list[str], drain_s: float) -> None:
        pass

    def close(self) -> None:
        pass


class TableRuntime(Runtime):
    def __init__(self, home: Path, backend: TableBackend) -> None:
        self.store = Store(home / "controller.db")
        self.backend = backend
        self.port, self.url, self.router_url = 0, "http://127.0.0.1:0", "http://127.0.0.1:0"

    def ensure_router(self) -> list[int]:
        return []

    def router_pids(self) -> list[int]:
        return []

    def kill_router(self) -> tuple[str, bool]:
        raise BackendError("no router here")

    def adopt(self, manager: GroupManager) -> list[str]:
        return []

    def stop_leftovers(self) -> int:
        return 0


def table_controller(home: Path, model_dir: Path, reconcile_s: float = 3600.0) -> tuple[Controller, TableBackend]:
    """A started controller whose reconcile loop waits `reconcile_s` between passes (the test calls reconcile())."""
    backend = TableBackend()
    config = ControllerConfig(model_dir=model_dir, reconcile_s=reconcile_s, adopt_wait_s=0, policy=POLICY)
    controller = Controller(config, TableRuntime(home, backend)).start()
    controller.manager.switch = QuietSwitch()
    return controller, backend
