"""profile_model: measure a role shape (prefill TTFT and tok/s, decode ITL and tok/s, the memory sums) and keep
the profile where capacity planning reads it ($TIDEFLOW_HOME/profiles)."""

from __future__ import annotations

from prefect import flow

from engine.capacity.profile import ProfileSpec, RoleProfile
from tasks.capacity import profile_shape


@flow(name="profile_model", log_prints=True)
def profile_model(spec: ProfileSpec = ProfileSpec()) -> RoleProfile:
    return profile_shape(spec)
