"""The local backend gives each member that asks for GPUs its own (issue #23): no two members of any group share
one, the member sees only its own (CUDA_VISIBLE_DEVICES) and is told to compute on it (--device cuda), and a
group that needs more than are free is refused before any member starts. The members are real `tideflow serve`
processes; on this GPU-less host they exit saying torch sees no CUDA device, which is the proof that they were
asked to compute on one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.group.backend import BackendError
from engine.group.gpus import GpuPool, GpuShortage
from engine.group.local import LocalProcessBackend, MemberRecord
from engine.group.spec import InferenceGroup

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_the_pool_hands_out_each_gpu_once_all_or_none():
    pool = GpuPool(["0", "1", "2"])
    assert pool.take({"a": 1, "b": 1}) == {"a": ["0"], "b": ["1"]}
    with pytest.raises(GpuShortage, match="needs 2 GPUs, 1 of this host's 3 are free"):
        pool.take({"c": 1, "d": 1})
    assert pool.free() == ["2"]  # the refused request took nothing
    pool.give_back({"a"})
    assert pool.take({"c": 2}) == {"c": ["0", "2"]}
    pool.give_back({"b", "c"})
    pool.hold("adopted", ["1"])
    assert pool.free() == ["0", "2"]
    assert pool.take({"cpu-only": 0}) == {"cpu-only": []}


class Ledger:
    def __init__(self) -> None:
        self.records: list[MemberRecord] = []

    def record(self, rec: MemberRecord) -> None:
        self.records.append(rec)

    def forget(self, handle_id: str) -> None:
        self.records = [r for r in self.records if r.handle_id != handle_id]


def gpu_group(name: str, model_dir: str, parallel: str = "DEP2") -> InferenceGroup:
    return InferenceGroup.model_validate({
        "name": name, "version": "v1", "model": {"path": model_dir},
        "roles": [{"role": "colocated", "parallel": parallel, "resources": {"gpus": 1},
                   "engine": {"kv_cache_bytes": 8_000_000}}]})


def wait_exited(backend: LocalProcessBackend, handle, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(m.phase.value in ("Failed", "Exited") for m in backend.members(handle)):
            return
        time.sleep(0.2)
    raise AssertionError(f"members still running after {timeout_s}s: {backend.members(handle)}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the members would serve: gpu_check covers it")
def test_dep_ranks_get_a_gpu_each_and_a_group_beyond_the_free_gpus_is_refused(tiny_model_dir, tmp_path):
    ledger = Ledger()
    backend = LocalProcessBackend(Path(tiny_model_dir), "member-key", log_dir=tmp_path, ledger=ledger,
                                  gpus=GpuPool(["3", "5"]))
    first = backend.start(gpu_group("first", str(tiny_model_dir)))
    try:
        assert sorted(r.gpus for r in ledger.records) == [["3"], ["5"]]
        with pytest.raises(BackendError, match=r"could not start group second: it needs 1 GPUs, 0 of this host's 2"):
            backend.start(gpu_group("second", str(tiny_model_dir), parallel="DEP1"))
        assert {r.group for r in ledger.records} == {"first"}  # the refused group started nothing
        wait_exited(backend, first)
        for member in backend.members(first):
            assert "--device cuda: torch sees no CUDA device" in member.message
    finally:
        backend.delete(first)
    second = backend.start(gpu_group("second", str(tiny_model_dir), parallel="DEP1"))  # the GPUs came back
    try:
        assert [r.gpus for r in ledger.records] == [["3"]]
    finally:
        backend.delete(second)
    assert backend.gpus.free() == ["3", "5"]
