"""Warm replacement in the controller: one serving group + one standby of the same version; a member of
the serving group is SIGKILLed under load: the standby takes its traffic at once, no client sees an error
(requests in flight migrate to it, new ones wait for it), and the fallen group is rebuilt into the warm
pool (not back into serving)."""

from __future__ import annotations

import threading

import openai
import pytest

from engine.control import discovery
from engine.control.models import ScalePool
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.scaling.policy import Bounds

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


@pytest.fixture(scope="module")
def pool(controller, tiny_model_dir):
    template = InferenceGroup.model_validate({
        "name": "warm", "version": "v1", "model": {"path": str(tiny_model_dir)},
        "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 8_000_000, "max_wait_ms": 2}}]})
    controller.scale_pool(ScalePool(template=template, target=1, warm_pool=1, bounds=Bounds(min_groups=0, max_groups=2)))
    assert controller.wait_for("warm-0", {GroupState.READY, GroupState.FAILED}, 120).state == GroupState.READY
    assert controller.wait_for("warm-1", {GroupState.STANDBY, GroupState.FAILED}, 120).state == GroupState.STANDBY
    return controller


def test_a_standby_takes_over_and_the_fallen_group_refills_the_pool(pool):
    client = openai.OpenAI(base_url=pool.status().router_url + "/v1", api_key=discovery.router_key(), max_retries=0,
                           timeout=60)
    after_kill: list[bool] = []
    errors: list[str] = []
    killed = threading.Event()
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model="default", prompt="warm", max_tokens=16)
                ok = True
            except openai.APIError as exc:
                ok = False
                errors.append(f"{type(exc).__name__}: {exc}")
            if killed.is_set():  # ended after the kill: in flight at it, or sent during the takeover
                after_kill.append(ok)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        hit = pool.kill("warm-0", "colocated")
        assert hit.landed
        killed.set()
        serving = pool.wait_for("warm-1", {GroupState.READY, GroupState.FAILED}, 30)
        assert serving.state == GroupState.READY
        assert pool.group("warm-0").state != GroupState.READY  # the traffic went to the standby, not a rebuild
        back = pool.wait_for("warm-0", {GroupState.STANDBY, GroupState.FAILED}, 120)
        assert back.state == GroupState.STANDBY and back.handle != hit.handle  # rebuilt whole, into the pool
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert after_kill and all(after_kill), f"{after_kill.count(False)} of {len(after_kill)} requests failed: {errors}"
    replaced = [e.message for e in pool.events() if e.kind == "replace" and "standby warm-1 serves" in e.message]
    assert replaced
    print(f"\n{replaced[-1]}; {len(after_kill)} requests after the kill, 0 errors")
    routed = {g["name"]: g["weight"] for g in pool.groups()}
    assert routed == {"warm-1": 100.0}  # warm-0 came up alone: 100 per unit of capacity, and warm-1 took it over
