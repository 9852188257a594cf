"""Fault drill on a live 1P+1D group run by a controller process: the controller kills the member,
the group is rebuilt as a unit, no request silently lost; with a warm standby, nothing lost at all."""

from __future__ import annotations

import pytest

from engine.control import discovery
from drills.fault import FaultDrillError, FaultDrillSpec, token_diff, run_fault_drill
from drills.fault_report import write_fault_report
from drills.spec import LoadDrillSpec
from engine.group.manager import GroupState
from engine.group.spec import InferenceGroup

# Members, routers and a controller killed under load: about 2.5 minutes on 2 cores; `make test-slow` (CI) runs it.
pytestmark = pytest.mark.slow


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
    print(f"\n{target}: {report.table()} {report.error_reasons}")


def test_unknown_target_is_a_clear_error(pd_group, monkeypatch):
    load = _load(pd_group, monkeypatch, rate=1, duration_s=1)
    with pytest.raises(FaultDrillError, match="no encoder member"):
        run_fault_drill(pd_group, FaultDrillSpec(group="drill-pd", target="encoder", load=load))


def test_unknown_group_is_a_clear_error(pd_group, monkeypatch):
    load = _load(pd_group, monkeypatch, rate=1, duration_s=1)
    with pytest.raises(FaultDrillError, match="no group 'nope'"):
        run_fault_drill(pd_group, FaultDrillSpec(group="nope", load=load))


def test_lost_and_duplicated_tokens_are_counted_against_the_replay():
    """The drill's token check can fail: a gap and a repeat in a stream are both seen."""
    reference = ["a", " b", " c", " d", " e"]
    assert token_diff(reference, reference) == (0, 0)
    assert token_diff(reference, ["a", " b", " d", " e"]) == (1, 0)
    assert token_diff(reference, ["a", " b", " c", " c", " d", " e"]) == (0, 1)
    assert token_diff(reference, ["a", " b", " x", " d", " e"]) == (1, 1)


def test_one_group_and_a_warm_standby_lose_nothing_when_decode_dies(pd_group, monkeypatch, tmp_path):
    """1 serving group + 1 standby copy (drill-pd out of traffic meanwhile; a group of its own, since the kills
    above spent drill-pd's restart budget): the standby takes the traffic at once, the streams open at the
    kill migrate to it and end exactly as an undisturbed run, the fallen group is rebuilt into the pool."""
    spec = pd_group.group("drill-pd").spec.model_copy(update={"name": "drill-sb"})
    pd_group.set_weights({"drill-pd": 0.0})
    pd_group.apply(spec, weight=1.0)
    pd_group.apply(spec.model_copy(update={"name": "drill-sb-warm"}), standby=True)
    try:
        assert pd_group.wait_for("drill-sb", {GroupState.READY, GroupState.FAILED}, 120).state == GroupState.READY
        assert pd_group.wait_for("drill-sb-warm", {GroupState.STANDBY, GroupState.FAILED}, 120).state == GroupState.STANDBY
        # constant arrivals: requests are in flight at any moment (a Poisson gap could leave none at the kill)
        load = _load(pd_group, monkeypatch, rate=8, duration_s=4, arrival="constant", prompt_len="uniform:8:24",
                     output_len="fixed:96")
        report = run_fault_drill(pd_group, FaultDrillSpec(group="drill-sb", target="decode", kill_after_s=1.5,
                                                          load=load, recovery_timeout_s=120))
        (run,) = report.runs
        print(f"\nstandby: {report.table()} {report.error_reasons}")
        assert report.accounted and report.errors == 0, report.error_reasons
        assert run.open_at_kill >= 1 and run.checked >= 1 and run.migrated >= 1
        assert run.lost_tokens == 0 and run.duplicated_tokens == 0 and run.unchecked == 0
        assert run.recover_s is not None and run.all_members_new and report.clean
        assert pd_group.group("drill-sb-warm").state == GroupState.READY  # the standby serves
        assert pd_group.group("drill-sb").state == GroupState.STANDBY  # the fallen one refilled the pool
        write_fault_report(report, tmp_path)
        assert all((tmp_path / name).stat().st_size > 0 for name in ("fault.json", "fault.csv", "fault.png"))
    finally:
        pd_group.delete("drill-sb")
        pd_group.delete("drill-sb-warm")
        pd_group.set_weights({"drill-pd": 1.0})


def test_a_router_kill_keeps_every_member_and_the_router_comes_back(pd_group, monkeypatch):
    """The controller kills one of its two router replicas (the default) and starts it again on the same port.
    The requests that replica held fail (a client's connection cannot move to another process); every request
    sent after the kill is answered by the survivor. What must hold: every request accounted for, none failed
    after the kill, the group untouched (same members), the replica back."""
    load = _load(pd_group, monkeypatch, rate=6, duration_s=3, prompt_len="uniform:8:24", output_len="fixed:16")
    report = run_fault_drill(pd_group, FaultDrillSpec(group="drill-pd", target="router", kill_after_s=1.0,
                                                      load=load, recovery_timeout_s=60))
    (run,) = report.runs
    print(f"\nrouter: {report.table()} {report.error_reasons}")
    assert run.killed.startswith("router (pid ") and report.accounted
    assert run.failed_after_kill == 0 and report.accounted
    assert run.recover_s is not None and run.members_as_expected and not run.all_members_new
    assert any(e.kind == "router" and "gone" in e.message and "starting it again" in e.message
               for e in pd_group.events())


def test_a_controller_kill_costs_no_request_and_no_member(pd_group, monkeypatch):
    """SIGKILL the controller under load; the drill starts it again with its own command line (as its
    supervisor would). The router keeps serving its last route set meanwhile, and the new controller
    adopts the running members: 0 errors, the same members, nothing lost."""
    load = _load(pd_group, monkeypatch, rate=6, duration_s=4, prompt_len="uniform:8:24", output_len="fixed:16")
    report = run_fault_drill(pd_group, FaultDrillSpec(group="drill-pd", target="controller", kill_after_s=1.0,
                                                      load=load, recovery_timeout_s=120))
    (run,) = report.runs
    print(f"\ncontroller: {report.table()} {report.error_reasons}")
    assert run.killed.startswith("controller (pid ")
    assert report.errors == 0 and run.members_as_expected and report.clean, report.error_reasons
    assert discovery.find().pid != int(run.killed.split("pid ")[1].rstrip(")"))  # a new controller serves
