"""What an operator can get wrong from the Prefect UI, against a real controller in its own process and a group
serving real traffic: a typo'd group, a drill on the serving group without permission, a second change while
one runs, a canary of a version already serving. Each is refused with a message that says what to do, and the
serving group is untouched (same build, same weight)."""

from __future__ import annotations

import pytest
import yaml
from prefect.client.orchestration import get_client

from engine.control.models import GroupView
from engine.group.manager import GroupState
from flows.canary_release import CanaryParams, canary_release, stable_group
from flows.deploy_group import deploy_group
from flows.drill_flows import DrillRefused, FaultDrillParams, drill_target, fault_drill
from flows.fleet_status import fleet_status
from flows.params import DeployParams
from flows.tidal_scale import TidalParams, tidal_scale

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


@pytest.fixture(scope="module")
def controller_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("specs") / "serving.yaml"
    path.write_text(yaml.safe_dump({"name": "serving", "version": "v1", "model": {"path": str(tiny_model_dir)},
                                    "roles": [{"role": "colocated", "engine": {"kv_cache_bytes": 8_000_000}}]}))
    return path


@pytest.fixture(scope="module")
def serving(flow_home, controller, spec_path):
    deploy_group(DeployParams(spec_file=spec_path, weight=100.0))
    return controller


def untouched(controller, before: GroupView) -> None:
    now = controller.group(before.name)
    assert (now.state, now.weight, now.handle) == (GroupState.READY, before.weight, before.handle)


def test_a_typo_in_a_drill_is_refused_and_deletes_nothing(serving):
    before = serving.group("serving")
    state = fault_drill(FaultDrillParams(group="servingg", target="colocated", allow_serving=True), return_state=True)
    assert state.is_failed()
    assert "no group named 'servingg'" in state.message and "serving (Ready, weight 100)" in state.message
    untouched(serving, before)
    assert not any(e.kind in ("delete", "kill") for e in serving.events())


def test_a_drill_of_the_serving_group_needs_allow_serving(serving):
    before = serving.group("serving")
    state = fault_drill(FaultDrillParams(target="colocated"), return_state=True)  # no group: the serving one
    assert state.is_failed() and "set allow_serving" in state.message, state.message
    untouched(serving, before)


def test_a_second_change_while_one_holds_the_fleet_is_refused_naming_it(serving, spec_path):
    before = serving.group("serving")
    serving.acquire_lease("nightly-run 42", "canary tideflow-v9 over serving")
    try:
        state = deploy_group(DeployParams(spec_file=spec_path, name="second", weight=1.0), return_state=True)
        assert state.is_failed() and "canary tideflow-v9 over serving" in state.message, state.message
        assert "second" not in {g.name for g in serving.status().groups}
        scale = tidal_scale(TidalParams(target=1, spec_file=spec_path), return_state=True)
        assert scale.is_failed() and "nightly-run 42" in scale.message, scale.message
    finally:
        assert serving.release_lease("nightly-run 42")
    untouched(serving, before)
    assert serving.status().lease is None  # and the refused runs hold nothing


def test_a_canary_of_a_version_that_already_serves_is_refused(serving, spec_path):
    before = serving.group("serving")
    state = canary_release(CanaryParams(canary=DeployParams(spec_file=spec_path, name="serving", version="v1")),
                           return_state=True)
    assert state.is_failed() and "already serves" in state.message, state.message
    untouched(serving, before)


def test_fleet_status_is_an_artifact_of_the_run(serving):
    state = fleet_status(return_state=True)
    assert state.is_completed()

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts()

    import asyncio

    (artifact,) = [a for a in asyncio.run(artifacts()) if a.flow_run_id == state.state_details.flow_run_id]
    assert artifact.key == "fleet-status" and artifact.type == "markdown"
    assert "| serving | v1 | serving at 100 | Ready | 100 | 100 % |" in artifact.data


def test_a_tidal_copy_takes_traffic_in_proportion_to_its_capacity(serving, tmp_path, tiny_model_dir):
    """Beside `serving` (weight 100, one member), a pool copy two members wide serves at weight 200: a third of the
    traffic each member, not the 1 % a flat weight of 1 gave it. The run ends only once it is routed."""
    template = tmp_path / "tide.yaml"
    template.write_text(yaml.safe_dump({"name": "tide", "version": "v1", "model": {"path": str(tiny_model_dir)},
                                        "roles": [{"role": "colocated", "instances": 2,
                                                   "engine": {"kv_cache_bytes": 8_000_000}}]}))
    bounds = {"min_groups": 0, "max_groups": 1}
    up = tidal_scale(TidalParams(target=1, warm_pool=0, spec_file=template, bounds=bounds), return_state=True)
    assert up.is_completed(), up.message
    routed = {g["name"]: g for g in serving.groups()}
    assert routed["tide-0"]["weight"] == 200.0 and routed["tide-0"]["routable"]
    assert routed["serving"]["weight"] == 100.0
    down = tidal_scale(TidalParams(target=0, floor=0, warm_pool=0, spec_file=template, bounds=bounds, confirm=True))
    assert down.serving == 0
    assert serving.group("serving").weight == 100.0


def _view(name: str, version: str, weight: float, state: GroupState = GroupState.READY) -> GroupView:
    return GroupView(name=name, version=version, state=state, weight=weight, standby=False, restarts=0)


def test_drill_target_names_only_what_is_asked():
    fleet = [_view("tideflow-v1", "v1", 100), _view("pool-0", "v1", 1), _view("pool-1", "v1", 0, GroupState.STANDBY)]
    assert drill_target(FaultDrillParams(allow_serving=True), fleet) == ("tideflow-v1", False)
    assert drill_target(FaultDrillParams(group="pool-1"), fleet) == ("pool-1", False)  # not serving: no permission
    assert drill_target(FaultDrillParams(group="scratch", create_if_missing=True), fleet) == ("scratch", True)
    with pytest.raises(DrillRefused, match="no group named 'tideflow-v2'.*tideflow-v1 \\(Ready, weight 100\\)"):
        drill_target(FaultDrillParams(group="tideflow-v2"), fleet)
    with pytest.raises(DrillRefused, match="pool-0 serves traffic"):
        drill_target(FaultDrillParams(group="pool-0"), fleet)
    with pytest.raises(DrillRefused, match="no group serves"):
        drill_target(FaultDrillParams(), [_view("pool-1", "v1", 0, GroupState.STANDBY)])


def test_the_stable_group_of_a_triggered_canary_is_the_one_the_new_version_replaces():
    fleet = [_view("tideflow-v1", "v1", 100), _view("pool-0", "v1", 1), _view("pool-1", "v1", 1),
             _view("tideflow-v7", "v7", 0)]
    assert stable_group(fleet, "tideflow-v7", "v7") == "tideflow-v1"  # whatever else serves
    pool_only = [_view("pool-0", "v1", 1), _view("tideflow-v7", "v7", 0)]
    assert stable_group(pool_only, "tideflow-v7", "v7") == "pool-0"
    from engine.canary.rollout import CanaryError

    with pytest.raises(CanaryError, match="pool-0, pool-1 serve with the same weight"):
        stable_group([_view("pool-0", "v1", 1), _view("pool-1", "v1", 1)], "tideflow-v7", "v7")
    with pytest.raises(CanaryError, match="no group of another version serves"):
        stable_group([_view("tideflow-v7", "v7", 100)], "tideflow-v8", "v7")
