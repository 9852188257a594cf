"""Leader election on Kubernetes: one coordination.k8s.io Lease, kept as client-go's leaderelection keeps it.

Two controller replicas run so that a lost node does not leave the fleet without a controller for the
minutes a new pod takes to be scheduled; only the one that holds the Lease acts (reconciles, writes the state
ConfigMap, serves the API). The other campaigns, and takes over once the holder stops renewing. The leader
labels its own pod LEADER_LABEL=true (a candidate sets it false first), and the controller Service selects
that label: readiness cannot be what routes to the leader, because a Deployment's rolling update waits for
its new pod to be Ready, and a candidate would never be while the old leader holds the Lease.

Expiry is judged by this process's own monotonic clock from when it last saw the Lease change (its holder,
renew time or resourceVersion), never by comparing the renew time written by another node's clock with ours:
clock skew between nodes cannot make two leaders. Every write carries the resourceVersion it read, so two
candidates racing for an expired Lease cannot both win (the API server refuses the second with 409). A
leader that cannot renew within `renew_deadline_s` (shorter than the Lease) gives up before anyone else may
take over; the controller then exits and Kubernetes starts it again as a candidate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field, model_validator
from urllib3.exceptions import HTTPError

log = logging.getLogger(__name__)

LEADER_LABEL = "tideflow.io/controller-leader"  # the controller Service selects "true" (controller.yaml)


class LeaseConfig(BaseModel):
    name: str = Field("tideflow-controller", description="the Lease object in the controller's namespace")
    duration_s: int = Field(15, ge=1, description="how long a holder that stopped renewing keeps the Lease")
    renew_deadline_s: float = Field(10.0, gt=0, description="a leader that has not renewed for this long gives up")
    retry_s: float = Field(2.0, gt=0, description="between two tries to acquire or renew")

    @model_validator(mode="after")
    def _deadline_inside_lease(self) -> "LeaseConfig":
        if not self.retry_s < self.renew_deadline_s < self.duration_s:
            raise ValueError("need retry_s < renew_deadline_s < duration_s: a leader must give up before its "
                             "Lease can be taken")
        return self


class LeaseError(Exception):
    """The Lease could not be read or written for a reason other than a lost race."""


class LeaseElector:
    """Campaign for, keep and release the Lease as `identity` (the pod's name)."""

    def __init__(self, api: client.ApiClient, namespace: str, identity: str, config: LeaseConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, pod: str | None = None) -> None:
        """`pod`: this replica's own pod, labelled LEADER_LABEL while it leads (None: no label, e.g. off a pod)."""
        self.api, self.namespace, self.identity = client.CoordinationV1Api(api), namespace, identity
        self.pods, self.pod, self.labelled = client.CoreV1Api(api), pod, False
        self.config, self.clock = config or LeaseConfig(), clock
        self.holder = ""  # who held it at the last look
        self._seen: tuple | None = None  # (holder, renew time, resourceVersion) at the last look
        self._seen_at = 0.0  # our clock when that last changed
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        # (connect, read) of every Lease call: a call that hangs (a black-holed API server) must not outlast the
        # renew deadline, or this leader would act past its Lease
        self._timeout = (min(2.0, self.config.renew_deadline_s / 4), self.config.renew_deadline_s / 2)
        self._renewed = 0.0  # our clock at the last renewal that succeeded

    # -- one try ------------------------------------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        """True when this candidate holds the Lease after the try."""
        name, ns = self.config.name, self.namespace
        try:
            lease = self.api.read_namespaced_lease(name, ns, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise LeaseError(f"read Lease {ns}/{name}: HTTP {exc.status} {exc.reason}") from None
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=name, namespace=ns),
                                  spec=self._spec(acquired=_now(), transitions=0))
            return self._write(lambda: self.api.create_namespaced_lease(ns, body, _request_timeout=self._timeout),
                               "create")
        spec = lease.spec or client.V1LeaseSpec()
        seen = (spec.holder_identity, spec.renew_time, lease.metadata.resource_version)
        if seen != self._seen:
            self._seen, self._seen_at = seen, self.clock()
        self.holder = spec.holder_identity or ""
        mine = self.holder == self.identity
        lasts_s = spec.lease_duration_seconds or self.config.duration_s
        if self.holder and not mine and self.clock() < self._seen_at + lasts_s:
            return False  # held by another, renewed within its duration as we saw it
        lease.spec = self._spec(acquired=spec.acquire_time if mine and spec.acquire_time else _now(),
                                transitions=(spec.lease_transitions or 0) + (0 if mine else 1))
        return self._write(lambda: self.api.replace_namespaced_lease(name, ns, lease, _request_timeout=self._timeout),
                           "replace")

    def _spec(self, acquired: datetime, transitions: int) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=self.config.duration_s,
                                  acquire_time=acquired, renew_time=_now(), lease_transitions=transitions)

    def _write(self, call: Callable[[], object], what: str) -> bool:
        try:
            call()
        except ApiException as exc:
            if exc.status == 409:  # another candidate wrote first: it holds the Lease now
                self.holder = ""  # who, the next read says
                return False
            raise LeaseError(f"{what} Lease {self.namespace}/{self.config.name}: HTTP {exc.status} {exc.reason}") from None
        self.holder = self.identity
        return True

    # -- the campaign, the term, the hand-over ----------------------------------------------------------------
    def label(self, leading: bool) -> bool:
        """Set this replica's pod's LEADER_LABEL; whether the API took it (a failure is logged, and the keeper
        tries again on its next renewal)."""
        if self.pod is None:
            return True
        body = {"metadata": {"labels": {LEADER_LABEL: "true" if leading else "false"}}}
        try:
            self.pods.patch_namespaced_pod(self.pod, self.namespace, body, _content_type="application/merge-patch+json",
                                           _request_timeout=self._timeout)
        except (ApiException, HTTPError, OSError) as exc:
            log.warning("leader election: could not label pod %s %s=%s: %s", self.pod, LEADER_LABEL, leading, exc)
            return False
        self.labelled = leading
        return True

    def campaign(self, stop: threading.Event | None = None) -> bool:
        """Try every retry_s until this candidate holds the Lease (True) or `stop` is set (False). Its pod is
        labelled as no leader first (a replica restarted in the pod it led from must not be routed to)."""
        stop = stop or threading.Event()
        said = None
        self.label(False)
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    log.warning("leader election: %s holds Lease %s/%s", self.identity, self.namespace, self.config.name)
                    self.label(True)
                    return True
                if self.holder != said:
                    said = self.holder
                    log.warning("leader election: %s waits; %s holds Lease %s/%s", self.identity, said or "nobody",
                                self.namespace, self.config.name)
            except (LeaseError, HTTPError, OSError) as exc:
                log.warning("leader election: %s", exc)
            stop.wait(self.config.retry_s)
        return False

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew every retry_s on a thread of its own; call `on_lost(why)` once, when another holder is seen or
        no renewal has succeeded for renew_deadline_s. A watchdog thread checks that deadline on its own, so a
        renewal stuck in a call cannot keep this leader acting past it."""
        lost = threading.Lock()  # on_lost runs once, from whichever thread sees it first
        self._renewed = self.clock()

        def give_up(why: str) -> None:
            if not self._stop.is_set() and lost.acquire(blocking=False):
                self._stop.set()
                on_lost(why)

        def renew() -> None:
            while not self._stop.wait(self.config.retry_s):
                try:
                    if self.try_acquire_or_renew():
                        self._renewed = self.clock()
                        if not self.labelled:  # the label failed before: the Service cannot reach this leader yet
                            self.label(True)
                        continue
                    give_up(f"{self.holder or 'another candidate'} holds the Lease now")
                    return
                except (LeaseError, HTTPError, OSError) as exc:
                    log.warning("leader election: renewal failed: %s; trying again", exc)

        def watch() -> None:
            while not self._stop.wait(min(self.config.retry_s, self.config.renew_deadline_s / 4)):
                late_s = self.clock() - self._renewed
                if late_s >= self.config.renew_deadline_s:
                    give_up(f"renewal failed for {late_s:.1f}s")
                    return

        self._keeper = threading.Thread(target=renew, name="lease-keeper", daemon=True)
        self._keeper.start()
        self._watchdog = threading.Thread(target=watch, name="lease-watchdog", daemon=True)
        self._watchdog.start()

    def release(self) -> None:
        """Stop renewing and hand the Lease over at once (no holder, 1 s left), if this candidate still holds it:
        a clean stop (a rolling update) lets the other replica lead without waiting out the Lease."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=self.config.retry_s + self.config.renew_deadline_s)
        self.label(False)  # first: the Service stops sending requests here before the other replica leads
        try:
            lease = self.api.read_namespaced_lease(self.config.name, self.namespace, _request_timeout=self._timeout)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity, lease.spec.lease_duration_seconds = None, 1
            lease.spec.renew_time = _now()
            self.api.replace_namespaced_lease(self.config.name, self.namespace, lease, _request_timeout=self._timeout)
        except (ApiException, HTTPError, OSError) as exc:  # it lapses by itself after duration_s
            log.warning("leader election: could not release Lease %s/%s: %s", self.namespace, self.config.name, exc)


def _now() -> datetime:
    return datetime.now(timezone.utc)
