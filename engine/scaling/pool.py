"""The warm pool of a group set: `scale_to(n)` serving groups, standby ones first, parking on the way down.

Every group is a copy of one InferenceGroup spec named `<name>-<i>`. Scaling up activates standby
groups (KV allocation + register, well under a second) and cold-starts the rest; the pool is then
refilled in the background to `warm_pool` standby groups. Scaling down parks groups (drained, KV
released, still loaded) and stops only standby groups beyond the pool size, so no in-flight request
is ever dropped.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from pydantic import BaseModel, Field

from engine.group.backend import BackendError
from engine.group.manager import GroupManager, GroupState, ManagedGroup
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds

log = logging.getLogger(__name__)

_STARTING = (GroupState.PENDING, GroupState.STARTING)


class ScaleResult(BaseModel):
    """What one `scale_to` call did; `activation_s` has one figure per group activated."""

    target: int = Field(ge=0, description="serving groups asked for, after the bounds")
    serving: int = Field(ge=0, description="serving groups after the call (Ready)")
    cold_starting: int = Field(ge=0, description="groups cold-starting to serve (Ready in a while)")
    standby: int = Field(ge=0, description="standby groups after the call (the warm pool)")
    activated: list[str] = Field(default_factory=list)
    parked: list[str] = Field(default_factory=list)
    cold_started: list[str] = Field(default_factory=list, description="started to serve because the pool ran dry")
    refilled: list[str] = Field(default_factory=list, description="started silent to refill the warm pool")
    stopped: list[str] = Field(default_factory=list, description="standby groups beyond the pool size, stopped")
    activation_s: list[float] = Field(default_factory=list, description="seconds each activation took")
    errors: list[str] = Field(default_factory=list, description="activations or parks that failed, with why")

    @property
    def changed(self) -> bool:
        return bool(self.activated or self.parked or self.cold_started or self.refilled or self.stopped or self.errors)


class WarmPool:
    """Scales one group set's copies of `template`; one `scale_to` at a time."""

    def __init__(self, manager: GroupManager, template: InferenceGroup, bounds: Bounds, warm_pool: int | None = None,
                 drain_s: float = 30.0, weight_of: Callable[[InferenceGroup], float] | None = None) -> None:
        """`weight_of(spec)`: the router weight a copy takes when it starts serving (default 1)."""
        self.manager, self.template, self.bounds = manager, template, bounds
        self.weight_of = weight_of or (lambda spec: 1.0)
        self.warm_pool = template.warm_pool if warm_pool is None else warm_pool
        self.drain_s = drain_s
        self._lock = threading.Lock()
        self._stoppers: list[threading.Thread] = []

    # -- observation -------------------------------------------------------------------------
    def groups(self) -> list[ManagedGroup]:
        prefix = self.template.name + "-"
        return [g for name, g in sorted(self.manager.groups.items(), key=lambda kv: _index(kv[0], prefix))
                if name.startswith(prefix) and name[len(prefix):].isdigit()]

    def _in(self, *states: GroupState) -> list[ManagedGroup]:
        return [g for g in self.groups() if g.status.state in states]

    def serving(self) -> list[ManagedGroup]:
        return self._in(GroupState.READY)

    def standby(self) -> list[ManagedGroup]:
        return self._in(GroupState.STANDBY)

    def cold_starting(self) -> list[ManagedGroup]:
        """Starting groups that will serve once Ready (as opposed to refills of the pool)."""
        return [g for g in self._in(*_STARTING) if not g.standby]

    def refilling(self) -> list[ManagedGroup]:
        return [g for g in self._in(*_STARTING) if g.standby]

    def capacity(self) -> int:
        """Serving groups plus those cold-starting to serve: what the autoscaler counts as current."""
        return len(self.serving()) + len(self.cold_starting())

    # -- control -------------------------------------------------------------------------------
    def up(self) -> ScaleResult:
        """Bring the set to its bounds' minimum and fill the warm pool (a fresh set starts here)."""
        return self.scale_to(self.bounds.min_groups)

    def scale_to(self, n: int, floor: int | None = None) -> ScaleResult:
        """Serve `n` groups, clamped to [floor, max_groups] (floor: bounds.min_groups unless a schedule lowers it):
        activate standby groups first, cold-start the rest, park (never kill) on the way down, then refill
        the warm pool to its size."""
        floor = self.bounds.min_groups if floor is None else floor
        target = min(max(n, floor), self.bounds.max_groups)
        result = ScaleResult(target=target, serving=0, cold_starting=0, standby=0)
        with self._lock:
            have = self.capacity()
            if target > have:
                self._grow(target - have, result)
            elif target < have:
                self._shrink(have - target, result)
            self._refill(result)
            result.serving, result.cold_starting = len(self.serving()), len(self.cold_starting())
            result.standby = len(self.standby())
        if result.changed:
            log.info("scale_to %d: serving %d (+%d cold), standby %d; activated %s parked %s", target, result.serving,
                     result.cold_starting, result.standby, result.activated, result.parked)
        return result

    def _grow(self, need: int, result: ScaleResult) -> None:
        picked = self.standby()[:need]
        for g in picked:
            g.weight = self.weight_of(g.spec)
        if picked:
            with ThreadPoolExecutor(max_workers=len(picked)) as pool:
                outcomes = list(pool.map(_try_activate, picked))
            for g, (took, error) in zip(picked, outcomes):
                if error is None:
                    result.activated.append(g.spec.name)
                    result.activation_s.append(took)
                else:
                    result.errors.append(error)
        for g in self.refilling()[: need - len(result.activated)]:
            g.standby = False  # a refill still loading serves as soon as it is Ready
            g.weight = self.weight_of(g.spec)
            result.cold_started.append(g.spec.name)
        for _ in range(need - len(result.activated) - len(result.cold_started)):
            result.cold_started.append(self._start(standby=False).spec.name)

    def _shrink(self, extra: int, result: ScaleResult) -> None:
        for g in reversed(self.cold_starting()):
            if extra == 0:
                return
            g.standby = True  # not Ready yet: it lands in the warm pool instead of serving
            extra -= 1
        for g in reversed(self.serving()[-extra:] if extra else []):
            try:
                g.park(self.drain_s)
                result.parked.append(g.spec.name)
            except BackendError as exc:
                result.errors.append(str(exc))

    def _refill(self, result: ScaleResult) -> None:
        spare = len(self.standby()) + len(self.refilling()) - self.warm_pool
        for _ in range(-spare):
            result.refilled.append(self._start(standby=True).spec.name)
        # beyond the pool size, stop refills still loading before loaded standby groups
        for g in (self.refilling()[::-1] + self.standby()[::-1])[: max(spare, 0)]:
            result.stopped.append(g.spec.name)
            stopper = threading.Thread(target=g.drain_and_stop, args=(self.drain_s,), name=f"stop-{g.spec.name}", daemon=True)
            stopper.start()
            self._stoppers.append(stopper)

    def _start(self, standby: bool) -> ManagedGroup:
        live = {g.spec.name for g in self.groups() if g.status.state not in (GroupState.STOPPED, GroupState.FAILED)}
        i = next(i for i in range(len(live) + 1) if f"{self.template.name}-{i}" not in live)
        spec = InferenceGroup.model_validate(
            self.template.model_copy(update={"name": f"{self.template.name}-{i}", "warm_pool": 0}).model_dump())
        return self.manager.up(spec, standby=standby, weight=self.weight_of(spec))

    def close(self, drain_s: float = 10.0) -> None:
        """Stop every group of the pool (draining serving ones) and wait for background stops."""
        for stopper in self._stoppers:
            stopper.join(timeout=drain_s + 30)
        for g in self.groups():
            if g.status.state not in (GroupState.STOPPED, GroupState.FAILED):
                g.drain_and_stop(drain_s)


def _try_activate(g: ManagedGroup) -> tuple[float, str | None]:
    try:
        return g.activate(), None
    except BackendError as exc:
        return 0.0, str(exc)


def _index(name: str, prefix: str) -> int:
    tail = name[len(prefix):]
    return int(tail) if name.startswith(prefix) and tail.isdigit() else -1

