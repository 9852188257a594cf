"""Capacity planning's tasks: profile_shape measures one role shape (engine.capacity.profile), plan_capacity plans
the day from profiles (engine.capacity.plan), apply_plan hands the plan to the controller's autoscaler."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from engine.capacity.apply import policy_from_plan
from engine.capacity.forecast import Forecast
from engine.capacity.plan import CapacityPlan, PlanSpec, as_table, plan
from engine.capacity.profile import ProfileSpec, RoleProfile, as_markdown, profile_role, save_profile
from engine.control.client import ControlClient
from engine.control.models import AutoscalerView
from engine.group.spec import InferenceGroup
from engine.scaling.policy import ScalingPolicy


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


@task(name="plan_capacity")
def plan_capacity(spec: PlanSpec, forecast: Forecast, prefill: RoleProfile, decode: RoleProfile | None) -> CapacityPlan:
    """Deterministic: the same profiles and forecast give the same plan; a plan that cannot be made fails the run
    with the reason (a target the shape cannot meet, a member that does not fit)."""
    result = plan(spec, forecast, prefill, decode)
    create_markdown_artifact(key="capacity-plan", markdown=as_table(result),
                             description=f"peak {result.peak_members} members, {result.member_hours} member-hours")
    return result


@task(name="apply_plan")
def apply_plan(result: CapacityPlan, template: InferenceGroup, base: ScalingPolicy) -> AutoscalerView:
    """The plan as the controller's autoscaler over the template's pool (durable: the controller keeps running it)."""
    policy = policy_from_plan(result, template, base)
    with ControlClient.connect() as client:
        view = client.start_autoscaler(template, policy)
    get_run_logger().info("autoscaler over pool %s follows the plan: %s", view.name,
                          ", ".join(f"{e.at:%H:%M} {e.groups}" for e in policy.schedule.entries))
    return view
