"""Kubernetes-style conditions of each group, derived from observation on every reconcile pass.

A condition says one thing about a group (is it available, is it being built, has it given up, does it run
as desired) with a machine-readable reason, a sentence, and when it last changed: an operator sees at a glance
what is wrong and since when, the way `kubectl describe` shows a LeaderWorkerSet's. The transition time
changes only when the condition's status does, so it reads "Failed since 10:02", not "as of the last poll".
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, Field

from engine.control.store import DesiredGroup
from engine.group.manager import GroupState, GroupStatus

ConditionType = Literal["Available", "Progressing", "Failed", "Converged"]
CONDITION_TYPES: tuple[ConditionType, ...] = ("Available", "Progressing", "Failed", "Converged")
HEALTHY: dict[ConditionType, str] = {"Available": "True", "Progressing": "False", "Failed": "False", "Converged": "True"}


class Condition(BaseModel):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase, for machines")
    message: str = Field("", description="for people")
    last_transition_time: str = Field(description="RFC 3339, UTC: when `status` last changed")

    @property
    def healthy(self) -> bool:
        return self.status == HEALTHY[self.type]


def observe(status: GroupStatus, want: DesiredGroup, weight: float, routed: float | None, standby: bool,
            retry_in_s: float | None, converge_error: str | None) -> list[tuple[ConditionType, str, str, str]]:
    """(type, status, reason, message) of each condition, from what the supervisor reports, the weight the route
    set gives the group (`routed`, None when it is not in it; `weight`: what it is to be routed at once serving),
    and what is wanted."""
    state, last = status.state, status.events[-1].message if status.events else ""
    serving = state == GroupState.READY
    if serving and routed is None:
        available = ("False", "NotRouted", "Ready, but not in the route set")
    elif serving and routed > 0:
        available = ("True", "Serving", f"routed at weight {routed:g}")
    elif serving:
        available = ("False", "ZeroWeight", "Ready but at weight 0: routed no traffic")
    elif state == GroupState.STANDBY:
        available = ("False", "Standby", "loaded and warm, not routed")
    else:
        available = ("False", state.value, last)
    building = state in (GroupState.PENDING, GroupState.STARTING)
    rebuilt = status.restarts or status.rebuilds or status.drill_rebuilds
    progressing = ("True", "Rebuilding" if rebuilt else "Building", last) if building else ("False", "Settled", "")
    if state == GroupState.FAILED:
        when = f"; built again in {retry_in_s:.0f}s" if retry_in_s is not None else ""
        failed = ("True", "GaveUp", f"{last}{when}")
    else:
        failed = ("False", "Running", "")
    if state not in (GroupState.READY, GroupState.STANDBY):
        converged = ("Unknown", "NotSettled", f"the group is {state.value}")
    elif converge_error is not None:
        converged = ("False", "ConvergeFailed", converge_error)
    elif standby != want.standby:
        converged = ("False", "Parking" if want.standby else "Activating",
                     "wanted in standby, serving" if want.standby else "wanted serving, in standby")
    elif (routed if serving else weight) != want.weight:
        now = routed if serving else weight
        converged = ("False", "Reweighting", f"weight {'none' if now is None else f'{now:g}'}, wanted {want.weight:g}")
    else:
        converged = ("True", "AsDesired", "")
    return [("Available", *available), ("Progressing", *progressing), ("Failed", *failed), ("Converged", *converged)]


class ConditionBook:
    """Each group's conditions, their transition times kept across passes. Thread-safe: reconcile writes,
    the API reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_group: dict[str, dict[str, Condition]] = {}

    def record(self, group: str, observed: list[tuple[ConditionType, str, str, str]]) -> None:
        now = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
        with self._lock:
            book = self._by_group.setdefault(group, {})
            for kind, status, reason, message in observed:
                old = book.get(kind)
                since = old.last_transition_time if old is not None and old.status == status else now
                book[kind] = Condition(type=kind, status=status, reason=reason, message=message[:500],
                                       last_transition_time=since)

    def of(self, group: str) -> list[Condition]:
        with self._lock:
            book = self._by_group.get(group, {})
            return [book[t] for t in CONDITION_TYPES if t in book]

    def forget(self, group: str) -> None:
        with self._lock:
            self._by_group.pop(group, None)
