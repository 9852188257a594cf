"""A group's status file is written by its supervisor thread and by control calls (park, drain) at
once: every write must land whole, and no writer may rename another's temporary file away."""

from __future__ import annotations

import json
import threading

from engine.group.manager import GroupState, ManagedGroup, SupervisionPolicy
from engine.group.spec import InferenceGroup

WRITERS, WRITES = 8, 60


def test_status_written_from_many_threads_is_always_whole(tmp_path):
    spec = InferenceGroup.model_validate({"name": "race", "version": "v1", "model": {"path": "unused"},
                                          "roles": [{"role": "colocated"}]})
    group = ManagedGroup(spec, backend=None, router=None, policy=SupervisionPolicy(), state_dir=tmp_path)
    path = tmp_path / "race.json"
    errors: list[BaseException] = []
    seen_events: list[int] = []
    done = threading.Event()

    def write(n: int) -> None:
        try:
            for i in range(WRITES):
                group._event(GroupState.STARTING if i % 2 else GroupState.READY, f"writer {n} write {i}")
        except BaseException as exc:  # noqa: BLE001 - any failure of a writer fails the test
            errors.append(exc)

    def read() -> None:
        while not done.is_set():
            try:
                seen_events.append(len(json.loads(path.read_text())["events"]))
            except FileNotFoundError:
                continue
            except BaseException as exc:  # noqa: BLE001 - a torn file is what this test looks for
                errors.append(exc)
                return

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(n,)) for n in range(WRITERS)]
    reader.start()
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert errors == []
    final = json.loads(path.read_text())
    assert len(final["events"]) == 1 + WRITERS * WRITES  # "accepted" plus every write, none lost
    assert seen_events and max(seen_events) <= len(final["events"])
    assert [p.name for p in tmp_path.iterdir()] == ["race.json"]  # no temporary file left behind


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


def test_an_unexpected_error_in_supervision_ends_the_group_failed_with_its_reason(tmp_path):
    """It used to kill the supervisor thread and leave the group Starting for ever."""
    spec = InferenceGroup.model_validate({"name": "broken", "version": "v1", "model": {"path": "unused"},
                                          "roles": [{"role": "colocated"}]})
    policy = SupervisionPolicy(max_restarts=1, backoff_s=0.0, poll_s=0.01)
    group = ManagedGroup(spec, backend=_BrokenBackend(), router=None, policy=policy, state_dir=tmp_path).start()
    assert group.wait_for({GroupState.FAILED}, 30) == GroupState.FAILED
    assert "supervision failed: RuntimeError: observation broke" in group.status.events[-1].message
    assert group.status.restarts == 1
    group._thread.join(10)  # the file is written after the state changes; the thread ends once it is
    assert json.loads((tmp_path / "broken.json").read_text())["state"] == "Failed"
