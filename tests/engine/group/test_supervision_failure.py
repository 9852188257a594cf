"""An error no backend declares, raised while a group is supervised, ends the group Failed with its reason."""

from __future__ import annotations

from engine.group.manager import GroupState, ManagedGroup, SupervisionPolicy
from engine.group.spec import InferenceGroup


class _BrokenBackend:
    """Starts nothing and cannot observe: members() raises what no backend declares."""

    name = "broken"

    def start(self, spec, standby=False):
        from engine.group.backend import GroupHandle
        return GroupHandle(id="h", group=spec.name, version=spec.version, backend=self.name, standby=standby)

    def members(self, handle):
        raise RuntimeError("observation broke")

    def delete(self, handle):
        pass


def test_an_unexpected_error_in_supervision_ends_the_group_failed_with_its_reason():
    """An unexpected error must not kill the supervisor thread and leave the group Starting for ever (kept from
    the removed status-file tests: this is what they also covered)."""
    spec = InferenceGroup.model_validate({"name": "broken", "version": "v1", "model": {"path": "unused"},
                                          "roles": [{"role": "colocated"}]})
    policy = SupervisionPolicy(max_restarts=1, backoff_s=0.0, poll_s=0.01)
    group = ManagedGroup(spec, backend=_BrokenBackend(), router=None, policy=policy).start()
    assert group.wait_for({GroupState.FAILED}, 30) == GroupState.FAILED
    assert "supervision failed: RuntimeError: observation broke" in group.status.events[-1].message
    assert group.status.restarts == 1
    group._thread.join(10)
    assert not group._thread.is_alive()  # the supervisor ended, with the group Failed
