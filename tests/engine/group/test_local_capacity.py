"""The local backend's host memory check (issue #37 item 4): a group whose members would not fit this host's memory
is refused before any member starts (started, they would swap or be OOM-killed, which reads as a crash loop), with
a message naming the need, the memory available and the largest member; a group that fits starts, and what it
holds counts against the next one."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine.group.backend import BackendError
from engine.group.capacity import (API_SERVER_OVERHEAD_BYTES, MEMBER_OVERHEAD_BYTES, CapacityCheck, MemberNeed,
                                   held_bytes, member_need)
from engine.group.local import LocalProcessBackend
from engine.group.manager import GroupManager, GroupState, SupervisionPolicy
from engine.group.spec import InferenceGroup

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

MEM = 8 << 30  # MemAvailable the estimates below are made against


def group(name: str, model_dir, roles: list[dict], dtype: str | None = None) -> InferenceGroup:
    model = {"path": str(model_dir)} | ({"dtype": dtype} if dtype else {})
    return InferenceGroup.model_validate({"name": name, "version": "v1", "model": model, "roles": roles})


def colocated(name: str, model_dir, instances: int = 1) -> InferenceGroup:
    return group(name, model_dir, [{"role": "colocated", "instances": instances,
                                    "engine": {"kv_cache_bytes": 16_000_000, "max_wait_ms": 0}}])


def test_a_member_needs_its_weights_kv_cache_and_processes(tiny_model_dir):
    state = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    experts = sum(t.numel() for name, t in state.items() if ".experts." in name)
    dense = sum(t.numel() for t in state.values()) - experts

    g = colocated("one", tiny_model_dir)
    assert member_need(g, g.roles[0], str(tiny_model_dir), MEM) == MemberNeed(
        weights=4 * (dense + experts), kv_cache=16_000_000, processes=MEMBER_OVERHEAD_BYTES)  # float32 checkpoint

    # served in bfloat16, a DEP2 rank holds half the experts; its kv_cache_fraction is of what is left once loaded
    g = group("dep", tiny_model_dir, [{"role": "colocated", "parallel": "DEP2", "engine": {"kv_cache_fraction": 0.5}}],
              dtype="bfloat16")
    need = member_need(g, g.roles[0], str(tiny_model_dir), MEM)
    assert need.weights == 2 * (dense + experts // 2)
    assert need.kv_cache == int(0.5 * (MEM - need.weights - MEMBER_OVERHEAD_BYTES))

    g = group("core", tiny_model_dir, [{"role": "colocated", "engine": {"engine_core": "process", "api_server_count": 2}}])
    need = member_need(g, g.roles[0], str(tiny_model_dir), MEM)
    assert need.processes == MEMBER_OVERHEAD_BYTES + 2 * API_SERVER_OVERHEAD_BYTES
    assert need.kv_cache == int(0.2 * (MEM - need.weights - need.processes))  # the engine's default fraction

    g = group("pd", tiny_model_dir, [{"role": "encoder"}, {"role": "prefill", "resources": {"gpus": 1}},
                                     {"role": "decode"}])
    vision = (Path(tiny_model_dir) / "vision_encoder" / "model.safetensors").stat().st_size
    assert member_need(g, g.role("encoder"), str(tiny_model_dir), MEM) == MemberNeed(
        weights=vision, kv_cache=0, processes=MEMBER_OVERHEAD_BYTES)
    assert member_need(g, g.role("prefill"), str(tiny_model_dir), MEM) == MemberNeed(  # on its GPU but its processes
        weights=0, kv_cache=0, processes=MEMBER_OVERHEAD_BYTES)


def test_a_group_that_does_not_fit_is_refused_before_any_member_starts(tiny_model_dir, tmp_path):
    big = colocated("big", tiny_model_dir, instances=2)
    need = member_need(big, big.roles[0], str(tiny_model_dir), MEM).total
    budget = need * 3 // 2  # one member fits, two do not
    logs = tmp_path / "logs"  # every member spawned opens its log file there
    backend = LocalProcessBackend(Path(tiny_model_dir), "member-key", log_dir=logs,
                                  capacity=CapacityCheck(mem_available_bytes=budget))
    with pytest.raises(BackendError) as info:
        backend.start(big)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    assert str(info.value).startswith(
        f"could not start group big: it needs {mib(2 * need)} of host memory for 2 members, but {mib(budget)} is "
        f"free for them (capacity_check.mem_available_bytes {mib(budget)}); the largest, colocated 0/0, needs "
        f"{mib(need)} (weights ")
    assert str(info.value).endswith("start the controller with --no-capacity-check")
    assert not logs.exists()

    # supervised, the refusal ends the group Failed with the reason (what `status` and `apply --wait-s` report)
    manager = GroupManager(backend, None, SupervisionPolicy(max_restarts=1, backoff_s=0.01))
    managed = manager.up(big)
    assert managed.wait_for({GroupState.FAILED}, 30) == GroupState.FAILED
    assert managed.status.events[-1].message.startswith(
        f"gave up after 1 restarts: could not start group big: it needs {mib(2 * need)} of host memory")
    assert not logs.exists()

    # the operator who knows better turns the check off: every member is spawned
    unchecked = LocalProcessBackend(Path(tiny_model_dir), "member-key", log_dir=logs,
                                    capacity=CapacityCheck(enabled=False, mem_available_bytes=budget))
    handle = unchecked.start(big)
    try:
        assert len(unchecked.pids(handle)) == 2 and len(list(logs.iterdir())) == 2
    finally:
        unchecked.delete(handle)


def test_a_group_that_fits_starts_and_what_it_holds_counts_against_the_next(tiny_model_dir, tmp_path):
    first = colocated("first", tiny_model_dir)
    need = member_need(first, first.roles[0], str(tiny_model_dir), MEM).total
    backend = LocalProcessBackend(Path(tiny_model_dir), "member-key", log_dir=tmp_path,
                                  capacity=CapacityCheck(mem_available_bytes=need * 3 // 2))
    handle = backend.start(first)
    try:
        assert backend.wait_ready(handle, 120), backend.members(handle)
        (pid,) = backend.pids(handle).values()
        assert 0 < held_bytes({pid})[pid] <= need  # the estimate covers what the loaded member holds
        with pytest.raises(BackendError, match=rf"could not start group second: it needs {need / 2**20:.1f} MiB .* "
                                               rf"less {need / 2**20:.1f} MiB that the members running here take"):
            backend.start(colocated("second", tiny_model_dir))
    finally:
        backend.delete(handle)
    backend.delete(backend.start(colocated("second", tiny_model_dir)))  # the first gone, the second fits
