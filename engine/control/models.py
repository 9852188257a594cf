"""The control API's bodies: one pydantic model per request and answer, shared by server and client."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from engine.control.conditions import Condition
from engine.control.expert_moves import ExpertMoves
from engine.control.routes import replica_urls
from engine.control.store import GroupDecision
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup, Role
from engine.router.registry import GroupName, Weight
from engine.scaling.policy import Bounds, ScalingPolicy



class ApplyGroup(BaseModel):
    """Desired state of one group: created when new, else its weight and serving/standby updated."""

    spec: InferenceGroup
    weight: float = Field(1.0, ge=0, allow_inf_nan=False, description="router weight once Ready")
    standby: bool = Field(False, description="start (or park) silent: loaded and warm, not routed")


class WeightsBody(BaseModel):
    weights: dict[GroupName, Weight] = Field(description="group name -> traffic weight (finite, >= 0)")


class WeightsSet(BaseModel):
    weights: dict[str, float] = Field(description="every routed group's weight after the change")
    revision: int = Field(description="the route set revision that carries it; in effect once every router replica "
                                      "serves it (GET /v1/routes/applied)")


class KillMember(BaseModel):
    """Which member a fault drill kills; `expert` = the first non-leader rank of a DEP instance."""

    target: Literal["prefill", "decode", "colocated", "encoder", "expert"] = "decode"


class Killed(BaseModel):
    member: str = Field(description="role/instance/rank of the killed member")
    id: str = Field(description="what was killed: 'pid N' (local) or 'pod NAME UID' (Kubernetes)")
    handle: str = Field(description="id of the group's build that was hit")
    before: list[str] = Field(description="the identity of every member of that build (a rebuild has none of them)")
    landed: bool = Field(description="the member was seen gone after the kill (the fault really happened)")


class ScalePool(BaseModel):
    """Serve `target` copies of `template` (named <template.name>-<i>), standby ones first."""

    template: InferenceGroup
    target: int = Field(ge=0, le=1000)
    bounds: Bounds = Field(default_factory=Bounds)
    warm_pool: int = Field(1, ge=0, le=100)
    floor: int | None = Field(None, ge=0)


class MemberView(BaseModel):
    role: Role
    instance: int
    rank: int
    endpoint: str | None
    phase: str
    pid: int | None = Field(None, description="process id on the local backend; None where there is none")
    id: str | None = Field(None, description="'pid N' or 'pod NAME UID': changes when the member is rebuilt")


class DesiredView(BaseModel):
    """The group as the user asked for it (its spec's weight and serving/standby)."""

    weight: float
    standby: bool


class GroupView(BaseModel):
    """One group: what was asked (`desired`, and the controller's own `decision` over it), what runs (state,
    weight, standby, members: observed), and its `conditions`."""

    name: str
    version: str
    state: GroupState
    weight: float
    standby: bool
    restarts: int = Field(description="rebuilds in a row that count against max_restarts (crashes)")
    drill_rebuilds: int = Field(0, description="rebuilds after a fault drill's kill: counted apart, no budget spent")
    handle: str | None = Field(None, description="id of the current build (changes on every rebuild)")
    message: str = Field("", description="the last event's message")
    last_activation_s: float | None = None
    members: list[MemberView] = Field(default_factory=list)
    spec: InferenceGroup | None = Field(None, description="what runs (a flow copies it for a warm standby)")
    desired: DesiredView | None = Field(None, description="what the user asked; None once the group is deleted")
    decision: GroupDecision | None = Field(None, description="the controller's own decision over what the user asked "
                                                             "(a warm replacement), until a user verb supersedes it")
    conditions: list[Condition] = Field(default_factory=list, description="Available, Progressing, Failed, Converged")
    expert_moves: ExpertMoves | None = Field(None, description="live expert moves of its current build's DEP instances "
                                                               "with replica slots, as last read; None for others")

    @property
    def serving(self) -> bool:
        """It takes traffic now: Ready and routed at a weight above 0."""
        return self.state == GroupState.READY and self.weight > 0

    def describe(self) -> str:
        """`name (state, weight w)`, as refusals list the fleet."""
        return f"{self.name} ({self.state.value}, weight {self.weight:g})"


def describe_fleet(groups: list[GroupView]) -> str:
    """Every group as `describe` puts it, for a message that says what the fleet has."""
    return ", ".join(g.describe() for g in groups) or "no groups"


class CanaryRecord(BaseModel):
    """The latest canary rollout as its flow reported it: in progress (decision None) or decided."""

    stable: str
    canary: str
    step: int = Field(ge=-1, description="index of the step being held; -1 before the first")
    percent: float = Field(ge=0, le=100, allow_inf_nan=False)
    decision: Literal["promoted", "rolled_back"] | None = None
    reason: str = ""
    at: float = Field(0.0, description="unix time of the last update (set by the controller)")


class LeaseRequest(BaseModel):
    """Ask for (or renew) the fleet lease: the one flow run allowed to change the fleet until it lets go."""

    holder: str = Field(min_length=1, max_length=200, pattern=r"^[\w.:@/ -]+$",
                        description="who asks: the flow run's id and name; the same holder renews")
    purpose: str = Field(min_length=1, max_length=300, description="what it changes, told to whoever is refused")
    ttl_s: float = Field(120.0, ge=5, le=3600, allow_inf_nan=False,
                         description="the lease lapses this long after the last renewal (a crashed run frees it)")


class Lease(BaseModel):
    holder: str
    purpose: str
    acquired_at: float = Field(description="unix time it was first granted to this holder")
    expires_at: float = Field(description="unix time it lapses unless renewed")


class FleetStatus(BaseModel):
    router_url: str
    router_pids: list[int] = Field(default_factory=list, description="the live router replicas' processes on the "
                                                                      "local backend (they share router_url's port)")
    backend: str = Field("local", description="where members run: local or kubernetes")
    router_replicas: list[dict] = Field(default_factory=list, description="router replicas watching the route set now")
    controller_pid: int
    groups: list[GroupView]

    def replica_urls(self) -> list[str]:
        """Where each live router replica alone answers (engine.control.routes.replica_urls)."""
        return replica_urls(self.router_replicas, self.router_url)
    canary: CanaryRecord | None = Field(None, description="the latest canary rollout")
    lease: Lease | None = Field(None, description="the flow run changing the fleet now, if any")


class ParkBody(BaseModel):
    drain_s: float = Field(30.0, ge=0, le=3600)


class Seconds(BaseModel):
    seconds: float


class AutoscalerBody(BaseModel):
    """Run the metric + schedule policy over the warm pool of copies of `template`, until stopped."""

    template: InferenceGroup
    policy: ScalingPolicy = Field(default_factory=ScalingPolicy)


class AutoscalerView(BaseModel):
    name: str = Field(description="the template's name: one autoscaler per pool")
    policy: ScalingPolicy
    decisions: int = Field(description="ticks whose target differed from the serving count")
    last: list[dict] = Field(default_factory=list, description="the latest scaling events, newest last")
