"""Fault drill on a live 1P+1D group: the group is rebuilt as a unit, no request silently lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.drills.fault import FaultDrillError, FaultDrillSpec, run_fault_drill
from engine.drills.spec import LoadDrillSpec
from engine.group.groupset import GroupSetConfig, LocalGroupSet
from engine.group.manager import GroupState, SupervisionPolicy
from engine.group.spec import InferenceGroup


@pytest.fixture(scope="module")
def pd_set(tiny_model_dir, tideflow_home):
    policy = SupervisionPolicy(ready_timeout_s=120, backoff_s=0.2, max_restarts=2, reset_after_s=1.0)
    spec = InferenceGroup.model_validate({
        "name": "drill-pd", "version": "v1", "model": {"path": str(tiny_model_dir)},
        "roles": [{"role": "prefill", "engine": {"kv_cache_bytes": 16_000_000}},
                  {"role": "decode", "engine": {"kv_cache_bytes": 16_000_000}}]})
    with LocalGroupSet(GroupSetConfig(model_dir=Path(tiny_model_dir), policy=policy)) as gs:
        group = gs.up(spec)
        assert group.wait_for({GroupState.READY, GroupState.FAILED}, 120) == GroupState.READY
        yield gs


@pytest.mark.parametrize("target,repeats", [("decode", 2), ("prefill", 1)])
def test_kill_member_under_load_is_rebuilt_and_accounted(pd_set, target, repeats, monkeypatch):
    monkeypatch.setenv("DRILL_KEY", pd_set.client_key)
    load = LoadDrillSpec(url=pd_set.url, model="default", api_key_env="DRILL_KEY", rate=6, duration_s=3,
                         prompt_len="uniform:8:24", output_len="fixed:16", expectations_suite=None, progress_bar=False)
    report = run_fault_drill(pd_set, FaultDrillSpec(group="drill-pd", target=target, repeats=repeats, kill_after_s=1.0,
                                                    load=load, recovery_timeout_s=60))
    assert report.accounted and report.sent > 0
    for run in report.runs:
        assert run.eject_s is not None and run.eject_s < 1.0
        assert run.recover_s is not None
        assert run.all_members_new
    print(f"\n{target}: recover {[round(r.recover_s, 1) for r in report.runs]} s, eject "
          f"{[round(r.eject_s * 1000) for r in report.runs]} ms, sent={report.sent} ok={report.ok} "
          f"errors={report.errors} {report.error_reasons}")


def test_unknown_target_is_a_clear_error(pd_set):
    load = LoadDrillSpec(url=pd_set.url, model="default", rate=1, duration_s=1, expectations_suite=None)
    with pytest.raises(FaultDrillError, match="no encoder member"):
        run_fault_drill(pd_set, FaultDrillSpec(group="drill-pd", target="encoder", load=load))
