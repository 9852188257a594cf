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
