"""profile_model as a flow run: the profile comes back as its result, lands in the home's profiles, and its tables
are the run's artifact (no controller: profiling measures one shape in the run's own process)."""

from __future__ import annotations

import asyncio

from prefect.client.orchestration import get_client

from engine.capacity.profile import ProfileSpec, RoleProfile
from flows.profile_model import profile_model


def test_a_profile_run_keeps_its_profile_and_shows_its_tables(prefect_api, tideflow_home, tiny_model_dir):
    spec = ProfileSpec(model_dir=tiny_model_dir, kv_cache_bytes=2_000_000, input_lens=[16], prefill_batches=[2],
                       concurrency=[2], contexts=[16], decode_tokens=4)
    state = profile_model(spec, return_state=True)
    assert state.is_completed(), state.message
    profile = state.result()
    (written,) = (tideflow_home / "profiles").glob("*.json")
    assert RoleProfile.model_validate_json(written.read_text()) == profile
    assert [(p.input_len, p.batch) for p in profile.prefill] == [(16, 2)] and profile.decode[0].itl_s > 0

    async def artifacts():
        async with get_client() as client:
            return await client.read_artifacts()

    (artifact,) = [a for a in asyncio.run(artifacts()) if a.flow_run_id == state.state_details.flow_run_id]
    assert artifact.key == "role-profile" and artifact.type == "markdown"
    assert "| 16 | 2 |" in artifact.data and "KV 512 bytes a token" in artifact.data
