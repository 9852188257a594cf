"""Live expert moves as the controller reports them. The ranks of a DEP instance with replica slots count the
moves they applied and refused, and the seconds each stalled them (engine.parallel.serving exports the counters).
The controller reads them from each instance's leader every `expert_watch_s` and turns each rise into an
`expert_lb` event and a line of `tideflow status`: an operator sees when experts moved, what it cost and what was
refused, without a Prometheus. Rank 0 speaks for its instance: the ranks agree on every move, all or nothing, so
their counts are equal."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from engine.group.backend import MemberStatus, Phase
from engine.group.spec import InferenceGroup
from engine.runtime.http import Key, bearer_client

log = logging.getLogger(__name__)

APPLIED = "tideflow_expert_rebalances_total"
REFUSED = "tideflow_expert_rebalance_failures_total"
STALL = "tideflow_expert_rebalance_seconds_sum"


class ExpertMoves(BaseModel):
    """One instance's live expert moves since its ranks started."""

    applied: int = Field(0, ge=0, description="rebalances the ranks applied")
    refused: int = Field(0, ge=0, description="rebalances refused or failed: the old placement kept")
    stall_s: float = Field(0.0, ge=0, description="seconds the applied ones stalled the ranks, summed")

    def rise_over(self, before: "ExpertMoves") -> str | None:
        """What happened since `before`, in words; None when nothing did (a restarted leader counts from 0)."""
        if self.applied < before.applied or self.refused < before.refused:
            before = ExpertMoves()
        applied, refused = self.applied - before.applied, self.refused - before.refused
        if not applied and not refused:
            return None
        parts = []
        if applied:
            parts.append(f"{applied} rebalance{'s' * (applied > 1)} applied "
                         f"({self.stall_s - before.stall_s:.2f} s of stalled steps)")
        if refused:
            parts.append(f"{refused} refused or failed, the old placement kept")
        return "; ".join(parts) + f" (since start: {self.applied} applied, {self.refused} refused)"


def read_moves(exposition: str) -> ExpertMoves:
    """The counters of one member's /metrics (0 where a counter is missing: no move yet)."""
    sums = {APPLIED: 0.0, REFUSED: 0.0, STALL: 0.0}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return ExpertMoves(applied=int(sums[APPLIED]), refused=int(sums[REFUSED]), stall_s=sums[STALL])


def moving_leaders(spec: InferenceGroup, members: Iterable[MemberStatus]) -> list[MemberStatus]:
    """The Ready rank-0 members of the roles with replica slots: the ones to ask (a member still starting, or of a
    build being replaced, has nothing to say of this build)."""
    roles = {r.role for r in spec.roles if r.redundant_experts}
    return [m for m in members if m.role in roles and m.rank == 0 and m.endpoint and m.phase == Phase.READY]


class MovesWatch:
    """The last counts seen per (group, build, instance): `observe` returns the events a new reading makes."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str, int], ExpertMoves] = {}
        self.totals: dict[str, ExpertMoves] = {}  # per group: its current build's instances summed

    def observe(self, group: str, handle: str, readings: dict[tuple[str, int], ExpertMoves]) -> list[str]:
        """`readings`: (role, instance) -> its leader's counts now. A build seen for the first time counts from
        0, so moves made before the first reading are reported too (a controller restarted over a running group
        reports that group's moves again, as totals since start)."""
        self._seen = {k: v for k, v in self._seen.items() if k[0] != group or k[1] == handle}  # a rebuild: anew
        events = []
        for (role, instance), moves in sorted(readings.items()):
            key = (group, handle, role, instance)
            said = moves.rise_over(self._seen.get(key, ExpertMoves()))
            self._seen[key] = moves
            if said:
                events.append(f"group {group} {role} instance {instance}: {said}")
        build = [v for k, v in self._seen.items() if k[0] == group]  # a leader silent now keeps its last counts
        self.totals[group] = ExpertMoves(applied=sum(m.applied for m in build), refused=sum(m.refused for m in build),
                                         stall_s=sum(m.stall_s for m in build))
        return events

    def forget_others(self, groups: set[str]) -> None:
        """Drop what was seen of groups that no longer run."""
        self._seen = {k: v for k, v in self._seen.items() if k[0] in groups}
        self.totals = {k: v for k, v in self.totals.items() if k in groups}


def scrape_moves(client: httpx.Client, leaders: list[MemberStatus],
                 stop: threading.Event | None = None) -> dict[tuple[str, int], ExpertMoves]:
    """Each leader's counts; a leader that does not answer now, or answers what is not an exposition, is left out
    of this reading (the others are read all the same). Stops early once `stop` is set."""
    out = {}
    for m in leaders:
        if stop is not None and stop.is_set():
            break
        try:
            r = client.get(f"{m.endpoint}/metrics")
            r.raise_for_status()
            out[(m.role, m.instance)] = read_moves(r.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("expert moves of %s %d/%d not read: %s", m.role, m.instance, m.rank, exc)
    return out


RunningGroup = tuple[InferenceGroup, str, list[MemberStatus]]  # spec, build id, members as last observed


class MovesReporter:
    """The controller's thread that asks the leaders every `period_s` (never under the controller's lock: a slow
    member delays only this) and records each rise as an `expert_lb` event."""

    def __init__(self, running: Callable[[], list[RunningGroup]], member_key: Key,
                 record: Callable[[str, str], None], period_s: float) -> None:
        self.running, self.member_key, self.record, self.period_s = running, member_key, record, period_s
        self.watch = MovesWatch()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="expert-moves", daemon=True)

    def start(self) -> None:
        if self.period_s > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception:  # one bad read must not end the reports
                log.exception("reading the expert move counters failed")

    def tick(self) -> None:
        running = self.running()
        with bearer_client(self.member_key, timeout_s=2.0) as client:
            for spec, handle, members in running:
                leaders = moving_leaders(spec, members)
                if not leaders:
                    continue
                readings = scrape_moves(client, leaders, self._stop)
                if self._stop.is_set():
                    return  # the controller is closing: nothing more is recorded
                for message in self.watch.observe(spec.name, handle, readings):
                    self.record("expert_lb", message)
        self.watch.forget_others({spec.name for spec, _, _ in running})
