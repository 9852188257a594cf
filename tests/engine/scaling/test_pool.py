"""scale_to on a real group set: standby groups are silent, used first on the way up, parked on the way down,
and the load generator running through it all loses no request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from drills.load import run_load_drill
from drills.spec import LoadDrillSpec
from engine.group.manager import GroupState
from engine.scaling.policy import Bounds
from engine.scaling.pool import WarmPool

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

KEY_ENV = "TIDEFLOW_SCALING_TEST_KEY"


def wait_until(check, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.1)


@pytest.fixture
def pool(groupset, template):
    pool = WarmPool(groupset.manager, template, Bounds(min_groups=1, max_groups=3), drain_s=20)
    try:
        yield pool
    finally:
        pool.close(drain_s=5)


def test_scale_up_and_down_through_the_warm_pool_loses_nothing(groupset, pool, monkeypatch):
    first = pool.up()
    assert first.cold_started == ["tide-0"] and first.refilled == ["tide-1"]
    wait_until(lambda: len(pool.serving()) == 1 and len(pool.standby()) == 1)

    silent = pool.standby()[0]
    url = silent.status.members[0].endpoint
    member = httpx.Client(headers={"authorization": f"Bearer {groupset.member_key}"}, trust_env=False, timeout=10)
    try:
        assert member.get(url + "/ready").json()["status"] == "standby"
        assert member.get(url + "/state").json()["kv_blocks"] == 0
        refused = member.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert [g["name"] for g in groupset.admin.groups()] == ["tide-0"]

        monkeypatch.setenv(KEY_ENV, groupset.client_key)
        spec = LoadDrillSpec(url=groupset.url, model="default", api_key_env=KEY_ENV, rate=6, duration_s=8,
                             prompt_len="uniform:8:16", output_len="fixed:16", expectations_suite=None,
                             progress_bar=False, request_timeout_s=30)
        reports = []
        drill = threading.Thread(target=lambda: reports.append(run_load_drill(spec)))
        drill.start()
        try:
            time.sleep(1.5)
            up = pool.scale_to(2)
            assert up.activated == ["tide-1"] and not up.cold_started and len(up.activation_s) == 1
            assert up.refilled == ["tide-2"]  # the pool is refilled in the background
            assert member.get(url + "/state").json()["state"] == "serving"
            assert silent.status.last_activation_s == up.activation_s[0]
            time.sleep(2.0)
            down = pool.scale_to(1)
            assert down.parked == ["tide-1"] and down.serving == 1 and down.standby == 1
            assert down.stopped == ["tide-2"]  # the parked group fills the pool: the refill still loading stops
        finally:
            drill.join(timeout=120)
        report = reports[0]
        assert report.sent == report.ok and report.error == 0, report.steps[0].error_reasons
        assert member.get(url + "/state").json() == {"state": "standby", "kv_blocks": 0, "open_requests": 0}
        assert sorted(g["name"] for g in groupset.admin.groups()) == ["tide-0"]
    finally:
        member.close()
    wait_until(lambda: pool.groups()[-1].status.state == GroupState.STOPPED)
    assert not pool.scale_to(1).changed


def test_scale_to_clamps_to_the_bounds(pool):
    assert pool.scale_to(99).target == 3
    assert pool.scale_to(0).target == 1
    assert pool.scale_to(0, floor=0).target == 0
