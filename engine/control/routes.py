"""The route set the controller publishes: what the GroupManager registers, what every router replica watches.

It answers the GroupManager with the verbs a router's admin API has (register, deregister, set
weights, in-flight), so group supervision is the same whether it pushes to one standalone router or
publishes here for any number of replicas. In-flight counts come from the replicas' reports: a
report counts for a group only once the replica serves the revision of the group's last change, so a
drain never mistakes a report from before "weight 0" for "nothing in flight".
"""

from __future__ import annotations

import threading
import time

from engine.router.admin import RouterAdminError
from engine.router.registry import Endpoint, GroupRegistration
from engine.router.sync import RouteSet, RouterReport

REPLICA_TTL_S = 3.0  # a replica that has not reported for this long is taken for gone


def replica_urls(replicas: list[dict], shared_url: str) -> list[str]:
    """Where each live router replica alone answers (`replicas` as RouteTable.replicas() lists them): its metrics
    and canary samples are read there, since the shared port reaches whichever replica the kernel picks. The
    shared URL when none reports such a place (one router, or routers started before replicas had ports of
    their own)."""
    return sorted({r["url"] for r in replicas if r.get("url")}) or [shared_url]


class NotPublished(Exception):
    """The controller is still adopting what runs: a router must keep the route set it has."""


class RouteTable:
    def __init__(self) -> None:
        self._regs: dict[str, GroupRegistration] = {}
        self._changed: dict[str, int] = {}  # group -> revision of its last change
        self._reports: dict[str, tuple[float, RouterReport]] = {}  # replica -> (monotonic time, report)
        self.revision = 0
        self._cond = threading.Condition()
        self._closed = False
        self._published = False  # until the controller has adopted what runs, an empty set would be a lie

    # -- what the GroupManager calls ------------------------------------------------------------------
    def register(self, name: str, version: str, endpoints: list[Endpoint], weight: float = 1.0) -> None:
        with self._cond:
            self._regs[name] = GroupRegistration(name=name, version=version, endpoints=endpoints, weight=weight)
            self._bump(name)

    def deregister(self, name: str) -> None:
        with self._cond:
            if self._regs.pop(name, None) is not None:
                self._bump(name)

    def weight_of(self, name: str) -> float | None:
        """The weight the routers are given for `name`; None when it is not in the route set."""
        with self._cond:
            reg = self._regs.get(name)
            return None if reg is None else reg.weight

    def set_weights(self, weights: dict[str, float]) -> dict[str, float]:
        with self._cond:
            unknown = sorted(set(weights) - set(self._regs))
            if unknown:
                raise RouterAdminError(f"not routed now (not Ready): {', '.join(unknown)}")
            for name, w in weights.items():
                if self._regs[name].weight != w:
                    self._regs[name] = self._regs[name].model_copy(update={"weight": w})
                    self._bump(name)
            return {n: r.weight for n, r in self._regs.items()}

    def inflight(self, name: str) -> int:
        """Requests in flight to `name` over every live replica; at least 1 while a live replica has not yet
        reported from the group's latest revision (it may still be sending under the old weight)."""
        with self._cond:
            changed = self._changed.get(name, 0)
            total, stale = 0, False
            for report in self._live():
                load = report.groups.get(name)
                total += load.inflight if load else 0
                stale |= report.revision < changed
            return max(total, 1) if stale else total

    def _bump(self, name: str) -> None:
        self.revision += 1
        self._changed[name] = self.revision
        self._cond.notify_all()

    # -- what the routers call --------------------------------------------------------------------------
    def publish(self) -> None:
        """From now on watches answer: the controller has re-adopted (and re-registered) what runs."""
        with self._cond:
            self._published = True
            self._cond.notify_all()

    def watch(self, after: int, wait_s: float) -> RouteSet:
        """The route set once its revision differs from `after` (at once for a new replica), or after `wait_s`.
        Raises NotPublished while a (re)started controller is still adopting: a restarted controller's
        empty table must never empty the routers that kept serving while it was away."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not self._published and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NotPublished("the controller is adopting the running groups; keep your route set")
                self._cond.wait(left)
            if self._closed:
                raise NotPublished("the controller is stopping; keep your route set")
            while self.revision == after and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return RouteSet(revision=self.revision, groups=list(self._regs.values()))

    def report(self, report: RouterReport) -> None:
        with self._cond:
            self._reports[report.replica] = (time.monotonic(), report)
            self._cond.notify_all()

    def forget_replicas(self, pids: list[int]) -> None:
        """Drop the reports of router replicas seen dead (pids on this machine): their URLs leave what status, the
        canary and the metric scrape read at once, not REPLICA_TTL_S later."""
        if not pids:
            return
        marks = tuple(f"/{pid}/" for pid in pids)
        with self._cond:
            self._reports = {k: v for k, v in self._reports.items() if not any(m in k for m in marks)}

    def close(self) -> None:
        """Ends every watch now (the controller is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- what status, the canary and the metric scrape read ----------------------------------------------------
    def groups(self) -> list[dict]:
        """Each routed group with its endpoints, weight, in-flight total and whether every live replica can route it."""
        with self._cond:
            live = self._live()
            out = []
            for name, reg in self._regs.items():
                loads = [r.groups.get(name) for r in live]
                out.append({"name": name, "version": reg.version, "weight": reg.weight,
                            "endpoints": [e.model_dump() for e in reg.endpoints],
                            "inflight": sum(load.inflight for load in loads if load),
                            "routable": bool(live) and all(load is not None and load.routable for load in loads),
                            "replicas": len(live)})
            return out

    def applied(self, revision: int) -> tuple[bool, int]:
        """(whether every live replica serves `revision` or a later one, how many replicas are live): a weight
        change is in effect only once they all do, and with no live replica it is in effect nowhere."""
        with self._cond:
            live = self._live()
            return bool(live) and all(r.revision >= revision for r in live), len(live)

    def replicas(self) -> list[dict]:
        with self._cond:
            now = time.monotonic()
            return [{"replica": r.replica, "revision": r.revision, "url": r.url, "key_state": r.key_state,
                     "seen_s_ago": round(now - at, 2)}
                    for at, r in self._reports.values() if now - at < REPLICA_TTL_S]

    def _live(self) -> list[RouterReport]:
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < REPLICA_TTL_S}
        return [r for _, r in self._reports.values()]
