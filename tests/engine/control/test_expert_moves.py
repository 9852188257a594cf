"""Live expert moves as `tideflow status` and the controller's events show them: read from a DEP instance's
leader, each rise one `expert_lb` event, a restarted leader or a rebuilt group counted anew."""

from __future__ import annotations

import re
import subprocess
import time

import openai
import pytest

from engine.control import discovery
from engine.control.expert_moves import ExpertMoves, MovesWatch, read_moves
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup
from engine.runtime.process import tideflow_argv

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

EXPOSITION = """# HELP tideflow_expert_rebalances_total live expert rebalances this rank applied
# TYPE tideflow_expert_rebalances_total counter
tideflow_expert_rebalances_total{group="g",version="v1"} 3.0
# HELP tideflow_expert_rebalance_failures_total expert rebalances refused or failed
# TYPE tideflow_expert_rebalance_failures_total counter
tideflow_expert_rebalance_failures_total{group="g",version="v1"} 1.0
# HELP tideflow_expert_rebalance_seconds one live rebalance check that moved experts
# TYPE tideflow_expert_rebalance_seconds histogram
tideflow_expert_rebalance_seconds_bucket{group="g",version="v1",le="+Inf"} 3.0
tideflow_expert_rebalance_seconds_count{group="g",version="v1"} 3.0
tideflow_expert_rebalance_seconds_sum{group="g",version="v1"} 1.5
"""


def test_a_members_counters_are_read_and_missing_ones_are_zero():
    assert read_moves(EXPOSITION) == ExpertMoves(applied=3, refused=1, stall_s=1.5)
    assert read_moves("# nothing moved yet\n") == ExpertMoves()


def test_each_rise_is_one_event_and_a_restarted_leader_counts_from_zero():
    watch = MovesWatch()
    first = watch.observe("g", "h1", {("decode", 0): ExpertMoves(applied=2, stall_s=0.5)})
    assert first == ["group g decode instance 0: 2 rebalances applied (0.50 s of stalled steps) "
                     "(since start: 2 applied, 0 refused)"]
    assert watch.observe("g", "h1", {("decode", 0): ExpertMoves(applied=2, stall_s=0.5)}) == []  # nothing new
    refused = watch.observe("g", "h1", {("decode", 0): ExpertMoves(applied=2, refused=1, stall_s=0.5)})
    assert refused == ["group g decode instance 0: 1 refused or failed, the old placement kept "
                       "(since start: 2 applied, 1 refused)"]
    restarted = watch.observe("g", "h1", {("decode", 0): ExpertMoves(applied=1, stall_s=0.2)})
    assert restarted and restarted[0].startswith("group g decode instance 0: 1 rebalance applied (0.20 s")
    assert watch.totals["g"] == ExpertMoves(applied=1, stall_s=0.2)


def test_a_silent_leader_keeps_its_counts_and_a_rebuild_starts_over():
    watch = MovesWatch()
    watch.observe("g", "h1", {("decode", 0): ExpertMoves(applied=2), ("decode", 1): ExpertMoves(applied=3)})
    assert watch.observe("g", "h1", {("decode", 0): ExpertMoves(applied=2)}) == []  # instance 1 did not answer
    assert watch.totals["g"].applied == 5
    assert watch.observe("g", "h2", {("decode", 0): ExpertMoves()}) == []  # the new build has moved nothing yet
    assert watch.totals["g"].applied == 0
    watch.forget_others(set())
    assert watch.totals == {}


@pytest.fixture(scope="module")
def dep_spec(tiny_model_dir):
    """A DEP2 decode instance with two replica slots, checking its expert load every 4 steps and moving on any
    imbalance, so moves happen under a few requests."""
    engine = {"kv_cache_bytes": 4_000_000, "max_wait_ms": 0}
    return InferenceGroup.model_validate({
        "name": "moving", "version": "v1", "model": {"path": str(tiny_model_dir)},
        "roles": [{"role": "prefill", "engine": engine},
                  {"role": "decode", "parallel": "DEP2", "engine": engine, "redundant_experts": 2,
                   "eplb_interval_steps": 4, "eplb_threshold": 1.0}]})


def test_live_moves_of_a_served_dep_group_are_events_and_a_status_line(controller, dep_spec):
    controller.apply(dep_spec)
    try:
        assert controller.wait_for("moving", {GroupState.READY, GroupState.FAILED}, 180).state == GroupState.READY
        client = openai.OpenAI(base_url=controller.status().router_url + "/v1", api_key=discovery.router_key(),
                               max_retries=0, timeout=60)
        for i in range(4):
            client.completions.create(model="default", prompt=f"the experts move {i}", max_tokens=24,
                                      extra_body={"ignore_eos": True})
        deadline = time.monotonic() + 60  # the controller reads the leaders every 5 s
        while not (moved := [e for e in controller.events() if e.kind == "expert_lb" and "group moving" in e.message]):
            assert time.monotonic() < deadline, [e.kind for e in controller.events()]
            time.sleep(0.5)
        assert "rebalance" in moved[0].message and "applied" in moved[0].message, moved[0].message
        view = controller.group("moving")
        assert view.expert_moves is not None and view.expert_moves.applied >= 1 and view.expert_moves.refused == 0
        shown = subprocess.run(tideflow_argv("status", "--events", "50"), capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        line = re.search(r"experts moved live: (\d+) rebalances applied \([0-9.]+ s of stalled steps\), 0 refused",
                         shown.stdout)
        assert line and int(line.group(1)) >= 1, shown.stdout
        assert "expert_lb" in shown.stdout and "group moving decode instance 0" in shown.stdout, shown.stdout
    finally:
        controller.delete("moving")
