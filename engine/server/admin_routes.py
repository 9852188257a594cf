"""Engine admin routes of the warm pool: /admin/activate, /admin/park and /state (engine API key)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from engine.server.standby import ServingSwitch, SwitchError, SwitchReport
from engine.api.errors import APIError


class ParkRequest(BaseModel):
    drain_s: float = Field(30.0, ge=0, le=3600, description="longest wait for open requests to finish")


class StateResponse(BaseModel):
    state: str = Field(description="loading, serving, standby or parking")
    kv_blocks: int = Field(ge=0, description="KV blocks allocated now")
    open_requests: int = Field(ge=0, description="requests submitted and not finished")


def admin_routes(switch: ServingSwitch) -> APIRouter:
    """Mount with the engine's auth dependency: these routes change what the instance costs and serves."""
    router = APIRouter()

    @router.post("/admin/activate")
    async def activate() -> SwitchReport:
        try:
            return await switch.activate()
        except SwitchError as exc:
            raise APIError(exc.status, str(exc), code="bad_state") from None

    @router.post("/admin/park")
    async def park(body: ParkRequest | None = None) -> SwitchReport:
        try:
            return await switch.park((body or ParkRequest()).drain_s)
        except SwitchError as exc:
            raise APIError(exc.status, str(exc), code="bad_state") from None

    @router.get("/state")
    async def state() -> StateResponse:
        engine = switch.engine
        return StateResponse(state=switch.state.value, kv_blocks=engine.kv_blocks, open_requests=engine.num_open)

    return router
