"""Fault drill on a live 1P+1D group run by a controller process: the controller kills the member,
the group is rebuilt as a unit, no request silently lost."""

from __future__ import annotations

import pytest

from engine.control import discovery
from engine.drills.fault import FaultDrillError, FaultDrillSpec, run_fault_drill
from engine.drills.spec import LoadDrillSpec
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup


@pytest.fixture(scope="module")
def pd_group(controller, tiny_model_dir):
    spec = InferenceGroup.model_validate({
        "name": "drill-pd", "version": "v1", "model": {"path": str(tiny_model_dir)},
        "roles": [{"role": "prefill", "engine": {"kv_cache_bytes": 16_000_000}},
                  {"role": "decode", "engine": {"kv_cache_bytes": 16_000_000}}]})
    controller.apply(spec)
    assert controller.wait_for("drill-pd", {GroupState.READY, GroupState.FAILED}, 120).state == GroupState.READY
    return controller


def _load(client, monkeypatch, **kw) -> LoadDrillSpec:
    monkeypatch.setenv("DRILL_KEY", discovery.router_key())
    return LoadDrillSpec(url=client.status().router_url, model="default", api_key_env="DRILL_KEY",
                         expectations_suite=None, progress_bar=False, **kw)


@pytest.mark.parametrize("target,repeats", [("decode", 2), ("prefill", 1)])
def test_kill_member_under_load_is_rebuilt_and_accounted(pd_group, target, repeats, monkeypatch):
    load = _load(pd_group, monkeypatch, rate=6, duration_s=3, prompt_len="uniform:8:24", output_len="fixed:16")
    report = run_fault_drill(pd_group, FaultDrillSpec(group="drill-pd", target=target, repeats=repeats,
                                                      kill_after_s=1.0, load=load, recovery_timeout_s=60))
    assert report.accounted and report.sent > 0
    for run in report.runs:
        assert run.killed.startswith(f"{target}/0/0 (pid ")
        assert run.eject_s is not None  # how fast is a figure for the report, not an assert
        assert run.recover_s is not None
        assert run.all_members_new
    print(f"\n{target}: recover {[round(r.recover_s, 1) for r in report.runs]} s, eject "
          f"{[round(r.eject_s * 1000) for r in report.runs]} ms, sent={report.sent} ok={report.ok} "
          f"errors={report.errors} {report.error_reasons}")


def test_unknown_target_is_a_clear_error(pd_group, monkeypatch):
    load = _load(pd_group, monkeypatch, rate=1, duration_s=1)
    with pytest.raises(FaultDrillError, match="no encoder member"):
        run_fault_drill(pd_group, FaultDrillSpec(group="drill-pd", target="encoder", load=load))


def test_unknown_group_is_a_clear_error(pd_group, monkeypatch):
    load = _load(pd_group, monkeypatch, rate=1, duration_s=1)
    with pytest.raises(FaultDrillError, match="no group 'nope'"):
        run_fault_drill(pd_group, FaultDrillSpec(group="nope", load=load))
