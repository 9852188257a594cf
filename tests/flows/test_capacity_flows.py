"""profile_model and capacity_plan as flow runs: the profile comes back as its result, lands in the home's
profiles, and its tables are the run's artifact; a plan from it is the run's result and artifact (no controller:
neither changes the fleet here; capacity_plan with `apply` is run as a deployment in test_served_deployments)."""

from __future__ import annotations

import asyncio

import pytest

from prefect.client.orchestration import get_client

from engine.capacity.plan import CapacityPlan
from engine.capacity.profile import ProfileSpec, RoleProfile
from flows.capacity_plan import CapacityPlanParams, capacity_plan
from flows.profile_model import profile_model

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)


def test_a_profile_run_keeps_its_profile_and_shows_its_tables(prefect_api, tideflow_home, tiny_model_dir):
    spec = ProfileSpec(model_dir=tiny_model_dir, kv_cache_bytes=2_000_000, input_lens=[16], prefill_batches=[2],
                       concurrency=[2], contexts=[16], decode_tokens=4)
    state = profile_model(spec, return_state=True)
    assert state.is_completed(), state.message
    profile = state.result()
    (written,) = (tideflow_home / "profiles").glob("*.json")
    assert RoleProfile.model_validate_json(written.read_text()) == profile
    assert [(p.input_len, p.batch) for p in profile.prefill] == [(16, 2)] and profile.decode[0].itl_s > 0

    (artifact,) = artifacts_of(state)
    assert artifact.key == "role-profile" and artifact.type == "markdown"
    assert "| 16 | 2 |" in artifact.data and "KV 512 bytes a token" in artifact.data


def test_a_plan_run_plans_from_a_profile_file_and_changes_nothing(prefect_api, tmp_path):
    from tests.engine.capacity.shapes import SPEC, shape

    profile = tmp_path / "shape.json"
    profile.write_text(shape().model_dump_json())
    forecast = tmp_path / "day.csv"
    forecast.write_text("\n".join(f"{h},{20 if 9 <= h < 18 else 1}" for h in range(24)))
    state = capacity_plan(CapacityPlanParams(profile=profile, plan=SPEC, forecast_csv=forecast), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert isinstance(result, CapacityPlan) and result.forecast.source == str(forecast)
    assert result.hours[12].members > result.hours[3].members and result.hours[8].warm_pool > 0
    (artifact,) = artifacts_of(state)
    assert artifact.key == "capacity-plan" and "| 12 | 20 |" in artifact.data


def artifacts_of(state) -> list:
    async def read():
        async with get_client() as client:
            return await client.read_artifacts()

    return [a for a in asyncio.run(read()) if a.flow_run_id == state.state_details.flow_run_id]
