"""Inference groups: the spec (spec.py), the Backend contract (backend.py) and its backends."""

from engine.group.backend import Backend, BackendError, GroupHandle, MemberStatus, Phase
from engine.group.spec import GroupSpecError, InferenceGroup, Member, RoleSpec

__all__ = ["Backend", "BackendError", "GroupHandle", "GroupSpecError", "InferenceGroup", "Member",
           "MemberStatus", "Phase", "RoleSpec"]
