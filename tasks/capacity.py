"""profile_shape: measure one role shape for capacity planning (engine.capacity.profile)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from engine.capacity.profile import ProfileSpec, RoleProfile, as_markdown, profile_role, save_profile


@task(name="profile_shape", timeout_seconds=3600)
def profile_shape(spec: ProfileSpec) -> RoleProfile:
    """No retries: a measurement that failed once (a context past the model's, a request that failed) fails the
    same way again. The profile is written to the home's profiles and shown as the run's artifact."""
    logger = get_run_logger()
    profile = profile_role(spec, progress=logger.info)
    path = save_profile(profile)
    logger.info("profile written to %s", path)
    create_markdown_artifact(key="role-profile", markdown=as_markdown(profile),
                             description=f"{profile.model} on {profile.host}")
    return profile
