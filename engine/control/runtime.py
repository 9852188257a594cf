"""What differs between running the fleet as processes on this machine and on Kubernetes, behind one interface.

The controller's logic (reconcile, apply, weights, pools, autoscalers, warm replacement) is the same on
both; a Runtime supplies the backend that runs members, the store that keeps desired state durable,
the router, and what a restarted controller does with what it finds running.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from engine.control.store import StateStore
from engine.group.backend import Backend
from engine.group.capacity import CapacityCheck
from engine.group.manager import GroupManager, SupervisionPolicy
from engine.runtime.tls import is_loopback

BACKEND_ENV = "TIDEFLOW_BACKEND"
NAMESPACE_ENV = "TIDEFLOW_NAMESPACE"


class ControllerConfig(BaseModel):
    backend: Literal["local", "kubernetes"] = Field(
        default_factory=lambda: os.environ.get(BACKEND_ENV, "local"),  # type: ignore[arg-type]
        description=f"where members run: processes here, or LeaderWorkerSets (also ${BACKEND_ENV})")
    model_dir: Path = Field(description="checkpoint of the router's tokenizer and of groups whose spec names none")
    model_name: str = Field("default", description="model id clients ask the router for")
    host: str = Field("127.0.0.1", description="bind address of the controller API (local: also the router and members)")
    port: int = Field(0, ge=0, le=65535, description="controller API port (0 = the one it had, else any free port)")
    router_port: int = Field(0, ge=0, le=65535, description="local: router port (0 = the one it had, else any free port)")
    router_replicas: int = Field(2, ge=1, le=16, description="local: router processes sharing the router port "
                                                            "(SO_REUSEPORT); one that dies is started again while "
                                                            "the others serve. Each also answers on a port of its "
                                                            "own, where the canary judge, the autoscaler and "
                                                            "Prometheus (GET /v1/targets) read its metrics and "
                                                            "samples")
    router_args: list[str] = Field(default_factory=list, description="local: extra `tideflow router` flags")
    router_url: str = Field("http://tideflow-router:8000",
                            description="kubernetes: the router Service clients use (reported by status)")
    namespace: str = Field(default_factory=lambda: os.environ.get(NAMESPACE_ENV, "default"),
                           description=f"kubernetes: namespace of the groups and the state ConfigMap (also ${NAMESPACE_ENV})")
    image: str = Field("tideflow:latest", description="kubernetes: image of the group members")
    reconcile_s: float = Field(0.5, gt=0, description="seconds between two reconcile passes")
    adopt_wait_s: float = Field(30.0, ge=0, description="at start, how long adopted groups may take to show Ready "
                                                         "before routers get the route set")
    expert_watch_s: float = Field(5.0, ge=0, description="seconds between reads of the expert move counters of DEP "
                                                         "groups with replica slots, each rise an `expert_lb` event "
                                                         "(0: not read)")
    policy: SupervisionPolicy = Field(default_factory=SupervisionPolicy, description="how groups are supervised and rebuilt")
    capacity_check: CapacityCheck = Field(default_factory=CapacityCheck,
                                          description="local: refuse a group that would not fit this host's memory")
    tls: Literal["auto", "on", "off"] = Field(
        "auto", description="local: TLS on every hop from the fleet CA in $TIDEFLOW_HOME/tls (mutual TLS to members); "
                            "auto: on when `host` is not a loopback address")
    cert_lifetime_h: float = Field(24.0, gt=0, description="local: hours a certificate the fleet CA issues is valid; "
                                                           "each is issued again with a third of its life left")

    @property
    def tls_on(self) -> bool:
        """The local runtime's fleet CA is in use (on Kubernetes the CA is not kept in a Secret yet: no TLS there)."""
        return self.backend == "local" and (self.tls == "on" or (self.tls == "auto" and not is_loopback(self.host)))


class Runtime(abc.ABC):
    store: StateStore
    backend: Backend
    port: int  # the controller API's port
    url: str  # where routers reach the controller API
    router_url: str  # where clients reach the router

    @abc.abstractmethod
    def ensure_router(self) -> list[int]:
        """Make sure a router watches this controller (called at start and on every reconcile pass); the pids of
        router replicas found gone meanwhile (their reports must not outlive them)."""

    def renew_certificates(self) -> list[str]:
        """Issue again the fleet's certificates that near their end (called on every reconcile pass); the names
        renewed. None on a runtime whose certificates come from elsewhere."""
        return []

    @abc.abstractmethod
    def router_pids(self) -> list[int]:
        """The live router replicas on this machine, if the runtime runs them."""

    @abc.abstractmethod
    def kill_router(self) -> tuple[str, bool]:
        """A fault drill's kill of one router replica: (what was killed, whether it was seen gone); the next
        reconcile pass starts it again."""

    @abc.abstractmethod
    def adopt(self, manager: GroupManager) -> list[str]:
        """At start: take over the running members of desired groups, stop those of groups nobody wants.
        Returns the groups taken over (running members that should be Ready again at once)."""

    @abc.abstractmethod
    def stop_leftovers(self) -> int:
        """After every group was stopped (`tideflow down`): stop whatever is still running; returns how many."""

