"""The shipped prefect.yaml through Prefect's public API: it is package data, entrypoints import, schedules
and triggers as stated, and a malformed entry is refused naming it."""

from __future__ import annotations

import tomllib
from fnmatch import fnmatch
from pathlib import Path

from prefect.flows import load_flow_from_entrypoint

import pytest

import flows
from engine.canary import CanaryPlan
from flows.deployments import (ENTRYPOINT_ROOT, SHIPPED_PREFECT_FILE, DeploymentsFileError, deployment_entries,
                               load_deployments, schedule_timezone)
from tasks.weights import PUBLISHED_EVENT

REPO = Path(__file__).resolve().parents[2]
PREFECT_YAML = SHIPPED_PREFECT_FILE


def test_the_shipped_file_is_package_data_so_an_installed_tideflow_ui_finds_it():
    assert PREFECT_YAML.is_file() and PREFECT_YAML.parent == Path(flows.__file__).resolve().parent
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["*"]
    assert any(fnmatch(PREFECT_YAML.name, p) for p in patterns), patterns
    assert ENTRYPOINT_ROOT == Path(flows.__file__).resolve().parents[1]  # entrypoints: flows/<file>.py:<flow>


def test_every_flow_has_a_deployment_whose_entrypoint_imports():
    configs = {c.name: c for c in deployment_entries(PREFECT_YAML)}
    assert set(configs) == {"build-kernels", "publish-weights", "deploy-group", "canary-release", "load-drill-nightly",
                            "fault-drill-nightly", "tidal-scale-up", "tidal-scale-down", "autoscaler", "fleet-status",
                            "kv-gc", "release", "profile-model", "capacity-plan"}
    for config in configs.values():
        flow = load_flow_from_entrypoint(str(ENTRYPOINT_ROOT / config.entrypoint), use_placeholder_flow=False)
        assert flow.name == config.entrypoint.rsplit(":", 1)[1]


def test_tidal_crons_nightly_drills_and_the_canary_trigger():
    configs = {c.name: c for c in deployment_entries(PREFECT_YAML)}

    def crons(name):
        return [(s.cron, s.timezone) for s in configs[name].schedules]

    assert crons("tidal-scale-up") == [("0 8 * * *", None)]  # the zone comes from where it is served
    assert crons("tidal-scale-down") == [("0 23 * * *", None)]
    assert configs["tidal-scale-up"].parameters["params"]["target"] > configs["tidal-scale-down"].parameters["params"]["target"]
    assert crons("load-drill-nightly") and crons("fault-drill-nightly") and crons("kv-gc")
    (trigger,) = configs["canary-release"].triggers
    assert trigger.expect == {PUBLISHED_EVENT}
    assert trigger.parameters["params"]["canary"]["weights_url"] == "{{ event.payload.url }}"


def test_the_triggered_canary_can_promote_at_the_traffic_of_a_small_fleet():
    """At 1 req/s, every step that shares traffic with the stable group reaches the judge's horizon (where a canary
    with no evidence of harm passes) before max_hold_s rolls it back as inconclusive."""
    (trigger,) = {c.name: c for c in deployment_entries(PREFECT_YAML)}["canary-release"].triggers
    plan = CanaryPlan.model_validate(trigger.parameters["params"]["plan"])
    for step in plan.steps:
        if step.percent < 100:
            assert plan.judge.horizon / (1.0 * step.percent / 100) <= step.max_hold_s, step


def test_deployments_build_for_serving(monkeypatch):
    monkeypatch.delenv("TZ", raising=False)
    deployments = {d.name: d for d in load_deployments(PREFECT_YAML)}
    assert deployments["tidal-scale-down"].schedules[0].schedule.cron == "0 23 * * *"
    assert deployments["tidal-scale-down"].schedules[0].schedule.timezone == "UTC"
    assert deployments["canary-release"].triggers


@pytest.mark.parametrize("tz, zone", [("Asia/Shanghai", "Asia/Shanghai"), (":Europe/Paris", "Europe/Paris"),
                                      ("CET-1CEST", "UTC"), ("", "UTC"), ("Mars/Olympus", "UTC")])
def test_crons_take_the_time_zone_of_tz_when_it_names_one(monkeypatch, tz, zone):
    monkeypatch.setenv("TZ", tz)
    assert schedule_timezone() == zone


def test_the_nightly_fault_drill_hits_the_serving_group_by_explicit_permission():
    params = {c.name: c for c in deployment_entries(PREFECT_YAML)}["fault-drill-nightly"].parameters["params"]
    assert params.get("allow_serving") is True and "group" not in params and not params.get("create_if_missing")


def test_a_malformed_entry_is_refused_naming_it(tmp_path):
    bad = tmp_path / "prefect.yaml"
    bad.write_text("deployments:\n  - name: nightly\n    entrypoint: flows/drill_flows.py:load_drill\n"
                   "    schedules: [{cron: '0 3 * * *', tz: UTC}]\n")
    with pytest.raises(DeploymentsFileError, match="nightly"):
        deployment_entries(bad)
