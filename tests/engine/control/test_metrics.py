"""The controller's series (engine.control.metrics): what the lifecycle board and the alerts read."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.control.metrics import CanaryGauge, ControllerMetrics, FleetSnapshot
from engine.runtime.errors import EXIT_PEER_LOST, EXIT_WEIGHTS
from engine.group.backend import MemberStatus, Phase
from engine.group.manager import GroupState, GroupStatus, failure_reason


def member(code: int | None) -> MemberStatus:
    return MemberStatus(role="decode", instance=0, rank=0, phase=Phase.FAILED, exit_code=code)


def test_a_member_failure_is_named_by_its_exit_status():
    assert failure_reason(member(EXIT_WEIGHTS)) == "weights"
    assert failure_reason(member(EXIT_PEER_LOST)) == "peer_lost"
    assert failure_reason(member(-9)) == failure_reason(member(137)) == "killed"
    assert failure_reason(member(1)) == failure_reason(member(None)) == "failed"


def samples(metrics: ControllerMetrics) -> dict[tuple, float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_fleet_is_read_at_scrape_time():
    fleet = FleetSnapshot(groups=[])
    metrics = ControllerMetrics(lambda: fleet)
    assert not any(name.startswith("tideflow_controller_group") for name, _ in samples(metrics))

    loop = GroupStatus(name="loop", version="v2", state=GroupState.STARTING, rebuilds=3, falls=2,
                       member_failures={"weights": 2, "failed": 1})
    spare = GroupStatus(name="spare", version="v1", state=GroupState.STANDBY)
    fleet = FleetSnapshot(groups=[(loop, 1.0, False), (spare, 0.0, True)],
                          canary=CanaryGauge(stable="spare", canary="loop", step=2, percent=25))
    seen = samples(metrics)
    state = {dict(k[1])["group"] + "/" + dict(k[1])["state"]: v for k, v in seen.items()
             if k[0] == "tideflow_controller_group_state"}
    assert state["loop/Starting"] == 1 and state["loop/Ready"] == 0 and state["spare/Standby"] == 1
    assert sum(state.values()) == 2  # one state per group
    labels = (("group", "loop"), ("version", "v2"))
    assert seen[("tideflow_controller_group_rebuilds_total", labels)] == 3
    assert seen[("tideflow_controller_group_falls_total", labels)] == 2
    weights = (("group", "loop"), ("reason", "weights"), ("version", "v2"))  # labels in name order
    assert seen[("tideflow_controller_member_failures_total", weights)] == 2
    assert seen[("tideflow_controller_group_standby", (("group", "spare"), ("version", "v1")))] == 1
    assert seen[("tideflow_controller_canary_percent", (("canary", "loop"), ("stable", "spare")))] == 25


def test_events_are_counted_and_every_labelled_series_exists_from_the_start():
    metrics = ControllerMetrics(lambda: FleetSnapshot(groups=[]))
    before = samples(metrics)
    assert before[("tideflow_controller_canary_decisions_total", (("decision", "rolled_back"),))] == 0
    assert before[("tideflow_controller_activation_seconds_count", (("trigger", "replacement"),))] == 0
    metrics.activation.labels("pool").observe(0.05)
    metrics.canary_decisions.labels("rolled_back").inc()
    metrics.observe_scale("pool", activated=1, parked=0, cold_started=0, refilled=2, stopped=0)
    after = samples(metrics)
    assert after[("tideflow_controller_activation_seconds_count", (("trigger", "pool"),))] == 1
    assert after[("tideflow_controller_canary_decisions_total", (("decision", "rolled_back"),))] == 1
    assert after[("tideflow_controller_pool_scale_total", (("action", "refilled"), ("pool", "pool")))] == 2
    assert after[("tideflow_controller_pool_scale_total", (("action", "parked"), ("pool", "pool")))] == 0
