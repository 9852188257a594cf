"""The Backend contract: what a GroupManager asks of the thing that runs group members.

Two implementations: local processes (`engine/group/local.py`) and Kubernetes LeaderWorkerSets
(`engine/group/k8s/backend.py`). A backend starts and stops whole groups and reports what it
observes; it never decides policy (when to recreate, when to register in the router) beyond what
its substrate does by itself (LWS recreates a failed instance on its own).
"""

from __future__ import annotations

import abc
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

from engine.runtime.errors import TideflowError
from engine.group.spec import InferenceGroup, Role


class BackendError(TideflowError):
    """The substrate refused or did not finish an operation; the message says what to check."""


class Phase(str, Enum):
    """A member's observed lifecycle phase."""

    PENDING = "Pending"  # accepted, not running yet (scheduling, pulling, spawning)
    RUNNING = "Running"  # process up, not answering /ready yet (loading weights, warming)
    READY = "Ready"  # answering /ready: can take requests
    FAILED = "Failed"  # exited non-zero or crash-looping; its instance will be rebuilt
    EXITED = "Exited"  # exited cleanly (stopped or drained)


class GroupHandle(BaseModel):
    """Names one started group; plain data, so flows can pass it between tasks."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="backend-unique id of this started group")
    group: str = Field(description="InferenceGroup.name")
    version: str = Field(description="InferenceGroup.version")
    backend: str = Field(description="which backend started it, e.g. 'local' or 'kubernetes'")
    standby: bool = Field(False, description="started silent: loaded and warm, not routable")


class MemberStatus(BaseModel):
    """What the backend observes of one member right now."""

    model_config = ConfigDict(frozen=True)

    role: Role
    instance: int = Field(ge=0, description="instance index within the role")
    rank: int = Field(ge=0, description="rank within the instance; 0 is the leader")
    endpoint: str | None = Field(None, description="http://host:port of the member's engine API, once known")
    phase: Phase
    restarts: int = Field(0, ge=0, description="times this member was restarted or recreated, as observed")
    message: str = Field("", description="why it is in this phase, when the substrate says")
    exit_code: int | None = Field(None, description="the process's exit status once it ended (negative: killed by "
                                                    "that signal), when the substrate says")


class MemberIdentity(BaseModel):
    """Which running thing a member is now: a process (local) or a pod (Kubernetes). A rebuilt member
    is a new identity, which is how a fault drill proves its instance was rebuilt."""

    model_config = ConfigDict(frozen=True)

    role: Role
    instance: int = Field(ge=0)
    rank: int = Field(ge=0)
    id: str = Field(description="'pid 1234' or 'pod <name> <uid>': unique among the members a backend ever ran")
    pid: int | None = Field(None, description="the process id on the local backend; None for a pod")


class Backend(abc.ABC):
    """Runs InferenceGroups. Every call is bounded in time; failures raise TideflowError subclasses."""

    name: str

    @abc.abstractmethod
    def start(self, group: InferenceGroup, standby: bool = False) -> GroupHandle:
        """Start every member of `group` (standby: silent, not routable) and return at once, without waiting for readiness."""

    @abc.abstractmethod
    def members(self, handle: GroupHandle) -> list[MemberStatus]:
        """Observed status of every member of the started group, sorted by (role, instance, rank)."""

    @abc.abstractmethod
    def wait_ready(self, handle: GroupHandle, timeout_s: float) -> bool:
        """Block until every member is Ready (True) or `timeout_s` passes (False)."""

    @abc.abstractmethod
    def stop(self, handle: GroupHandle, drain_s: float) -> None:
        """Take the group out of routing, let in-flight requests finish for up to `drain_s`, then stop every member."""

    @abc.abstractmethod
    def scale(self, group_name: str, role: Role, instances: int) -> None:
        """Set the number of instances of one role of a running group; each instance starts or stops whole."""

    @abc.abstractmethod
    def delete(self, handle: GroupHandle) -> None:
        """Remove everything the group created and return once no member is left."""

    @abc.abstractmethod
    def identities(self, handle: GroupHandle) -> list[MemberIdentity]:
        """The running thing behind every member of the build now, sorted by (role, instance, rank)."""

    @abc.abstractmethod
    def kill(self, handle: GroupHandle, member: MemberIdentity, confirm_s: float = 10.0) -> bool:
        """Kill one member at once, with no grace (fault drills): True when it was seen gone within `confirm_s`
        (a fault that did not land must not count as one)."""
