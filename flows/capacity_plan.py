"""capacity_plan: plan the day's prefill and decode members from measured profiles and a forecast (TTFT and ITL
targets, queueing counted, the warm pool ahead of ramps) and, with `apply`, hand the plan to the controller's
autoscaler over a template's pool. Without a profile it measures the default model's first (profile_model)."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from pydantic import BaseModel, Field

from engine.capacity.forecast import TidalShape, from_csv
from engine.capacity.plan import SLO, CapacityPlan, PlanSpec
from engine.capacity.profile import ProfileSpec, RoleProfile
from engine.group.spec import InferenceGroup
from engine.scaling.policy import ScalingPolicy
from tasks.capacity import apply_plan, plan_capacity, profile_shape
from tasks.fleet import changing_fleet


class CapacityPlanParams(BaseModel):
    profile: Path | None = Field(None, description="a `tideflow profile` JSON (prefill, and decode unless "
                                                   "decode_profile); None: measure the default model first")
    decode_profile: Path | None = Field(None, description="the decode role's profile, when its shape differs")
    plan: PlanSpec = Field(default_factory=lambda: PlanSpec(slo=SLO(ttft_p90_s=1.0, itl_p90_s=0.05), input_tokens=256,
                                                            output_tokens=128),
                           description="targets, the typical request, headroom, cold start, member memory")
    forecast_csv: Path | None = Field(None, description="`hour,rps` rows for hours 0-23; None: the tidal day below")
    tidal: TidalShape = Field(default_factory=TidalShape, description="the built-in tidal day's rates and hours")
    timezone: str = Field("UTC", description="the zone of the forecast's hours (and of the schedule applied)")
    apply: bool = Field(False, description="hand the plan to the controller's autoscaler over spec_file's pool")
    spec_file: Path = Field(Path("deployments/groups/tiny-colocated.yaml"), description="template of the pool's groups")
    policy: ScalingPolicy = Field(default_factory=ScalingPolicy, description="the metric part and tick kept when "
                                                                             "applied (schedule, bounds, warm pool "
                                                                             "come from the plan)")


def _read(path: Path) -> RoleProfile:
    return RoleProfile.model_validate_json(Path(path).read_text())


@flow(name="capacity_plan", log_prints=True)
def capacity_plan(params: CapacityPlanParams = CapacityPlanParams()) -> CapacityPlan:
    forecast = (from_csv(params.forecast_csv, params.timezone) if params.forecast_csv is not None
                else params.tidal.forecast(params.timezone))
    prefill = _read(params.profile) if params.profile is not None else profile_shape(ProfileSpec())
    decode = _read(params.decode_profile) if params.decode_profile is not None else None
    result = plan_capacity(params.plan, forecast, prefill, decode)
    if params.apply:
        template = InferenceGroup.from_yaml(params.spec_file)
        with changing_fleet(f"capacity plan over pool {template.name}"):
            apply_plan(result, template, params.policy)
    return result
