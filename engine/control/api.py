"""The control API: every verb a task needs, behind the controller's admin key, with pydantic bodies.

Handlers are plain functions (FastAPI runs them on its thread pool), because parking or deleting a
group drains it, which may take seconds and must not stall the other calls.
"""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.control.audit_http import AuditMiddleware
from engine.control.controller import ControlError, Controller
from engine.control.routes import NotPublished
from engine.control.models import (ApplyGroup, AutoscalerBody, AutoscalerView, CanaryRecord, FleetStatus,
                                   GroupView, Killed, KillMember, Lease, LeaseRequest, ParkBody, ScalePool, Seconds,
                                   WeightsBody, WeightsSet)
from engine.control.store import Event
from engine.control.keys import Rotated, RotateKey
from engine.control.targets import Job, TargetGroup
from engine.router.registry import GROUP_NAME_PATTERN
from engine.router.sync import RouteSet, RouterReport
from engine.scaling.pool import ScaleResult
from engine.api.auth import BearerAuth, KeySource, publish_openapi
from engine.api.limits import BodyLimit
from engine.api.errors import APIError, install_error_handlers
from engine.telemetry.tracing import FASTAPI_OWN_TELEMETRY_OFF

GroupName = Annotated[str, Path(pattern=GROUP_NAME_PATTERN, description="group name (a DNS-1123 label)")]


def create_control_app(controller: Controller, on_down: Callable[[], None], body_timeout_s: float) -> FastAPI:
    """`on_down` ends the serving process after `POST /v1/down` has stopped the fleet."""
    keys = controller.keys  # each check reads the keys accepted now: a rotated one at once, an old one in its grace
    auth = BearerAuth(KeySource(dynamic=lambda: keys.accepted("admin")))
    # router replicas: the route set only
    router_auth = BearerAuth(KeySource(dynamic=lambda: [*keys.accepted("routes"), *keys.accepted("admin")]))
    reader_auth = BearerAuth(KeySource(dynamic=lambda: [*keys.accepted("client"), *keys.accepted("admin")]))
    app = FastAPI(title="tideflow controller", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=FASTAPI_OWN_TELEMETRY_OFF)
    app.add_middleware(BodyLimit, max_bytes=1 << 20, read_timeout_s=body_timeout_s)  # specs and small bodies only
    app.add_middleware(AuditMiddleware, audit=controller.audit, roles=controller.key_roles)  # outermost: sees all
    publish_openapi(app, auth)
    install_error_handlers(app)
    api = APIRouter(dependencies=[Depends(auth)])

    @app.get("/metrics", dependencies=[Depends(reader_auth)])
    def metrics() -> Response:
        """The lifecycle series (engine.control.metrics), with the key Prometheus already scrapes the router with."""
        return Response(generate_latest(controller.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")  # open: probes carry no secrets
    def health() -> dict:
        return {"status": "alive"}

    @app.get("/ready")  # open: the Service routes to the controller that leads (on Kubernetes: holds the Lease)
    def ready() -> dict:
        return {"ready": True, "leader": True}

    def call(fn, *args):
        try:
            return fn(*args)
        except ControlError as exc:
            raise APIError(exc.status, str(exc)) from None

    @api.get("/v1/status")
    def status() -> FleetStatus:
        return controller.status()

    @api.get("/v1/groups/{name}")
    def group(name: GroupName) -> GroupView:
        return call(controller.view, name)

    @api.put("/v1/groups")
    def apply(body: ApplyGroup) -> GroupView:
        return call(controller.apply, body)

    @api.delete("/v1/groups/{name}")
    def delete(name: GroupName, drain_s: Annotated[float, Query(ge=0, le=3600)] = 10.0) -> dict:
        call(controller.delete, name, drain_s)
        return {"deleted": name}

    @api.put("/v1/weights")
    def weights(body: WeightsBody) -> WeightsSet:
        """The weights now routed, and the route set revision that carries them (`GET /v1/routes/applied`)."""
        return call(controller.set_weights, body.weights)

    @api.get("/v1/routes/applied")
    def applied(revision: Annotated[int, Query(ge=0)]) -> dict:
        """Whether every live router replica serves `revision` (or later)."""
        done, replicas = controller.routes.applied(revision)
        return {"applied": done, "replicas": replicas}

    @api.post("/v1/groups/{name}/activate")
    def activate(name: GroupName) -> Seconds:
        return Seconds(seconds=call(controller.activate, name))

    @api.post("/v1/groups/{name}/park")
    def park(name: GroupName, body: ParkBody) -> Seconds:
        return Seconds(seconds=call(controller.park, name, body.drain_s))

    @api.post("/v1/groups/{name}/kill")
    def kill(name: GroupName, body: KillMember) -> Killed:
        return call(controller.kill_member, name, body)

    @api.post("/v1/router/kill")
    def kill_router() -> Killed:
        return call(controller.kill_router)

    @api.post("/v1/pools/scale")
    def scale(body: ScalePool) -> ScaleResult:
        return call(controller.scale_pool, body)

    @api.put("/v1/autoscalers")
    def start_autoscaler(body: AutoscalerBody) -> AutoscalerView:
        return call(controller.start_autoscaler, body)

    @api.get("/v1/autoscalers/{name}")
    def autoscaler(name: GroupName) -> AutoscalerView:
        return call(controller.autoscaler_view, name)

    @api.delete("/v1/autoscalers/{name}")
    def stop_autoscaler(name: GroupName) -> dict:
        if not controller.stop_autoscaler(name):
            raise APIError(404, f"no autoscaler over pool {name!r}")
        return {"stopped": name}

    @api.put("/v1/canary")
    def canary(body: CanaryRecord) -> CanaryRecord:
        return controller.record_canary(body)

    @api.put("/v1/lease")
    def lease(body: LeaseRequest) -> Lease:
        """Take or renew the fleet lease; 409 while another flow run holds it."""
        return call(controller.acquire_lease, body)

    @api.delete("/v1/lease")
    def release_lease(holder: Annotated[str, Query(min_length=1, max_length=200)]) -> dict:
        return {"released": controller.release_lease(holder)}

    @api.get("/v1/router/groups")
    def router_groups() -> dict:
        """The routed groups with the replicas' view: weights, routable, in-flight counts (canary and drains read it)."""
        return {"groups": controller.routes.groups()}

    @app.get("/v1/routes", dependencies=[Depends(router_auth)])
    def routes(after: Annotated[int, Query(ge=0)] = 0,
               wait_s: Annotated[float, Query(ge=0, le=60)] = 0.0) -> RouteSet:
        """Long poll: answers once the route set's revision differs from `after`, or after `wait_s`."""
        try:
            return controller.routes.watch(after, wait_s)
        except NotPublished as exc:
            raise APIError(503, str(exc)) from None

    @app.post("/v1/routes/report", dependencies=[Depends(router_auth)])
    def report(body: RouterReport) -> dict:
        controller.routes.report(body)
        return {"revision": controller.routes.revision}

    @app.get("/v1/targets", dependencies=[Depends(reader_auth)])
    def targets(job: Job) -> list[TargetGroup]:
        """Prometheus HTTP service discovery (http_sd_configs), with the key it scrapes the router with."""
        return controller.scrape_targets(job)

    @api.post("/v1/keys/rotate")
    def rotate(body: RotateKey) -> Rotated:
        """A new key for the role, working at once; the old one works for the grace, then is refused."""
        return call(controller.rotate_key, body.role, body.grace_s)

    @api.get("/v1/metrics/members")
    def member_metrics() -> dict:
        return {"texts": controller.member_metrics()}

    @api.get("/v1/events")
    def events(limit: Annotated[int, Query(ge=1, le=10000)] = 200) -> list[Event]:
        return controller.store.events(limit)

    @api.post("/v1/down")
    def down() -> dict:
        controller.close(stop_fleet=True)
        on_down()
        return {"down": True}

    app.include_router(api)
    return app


def create_standby_app(leader: Callable[[], str]) -> FastAPI:
    """What a controller replica that campaigns for the Lease answers: alive, not ready (the Service sends it
    nothing), and who leads (`leader()`: the Lease's holder as last seen)."""
    app = FastAPI(title="tideflow controller (standby)", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=FASTAPI_OWN_TELEMETRY_OFF)

    @app.get("/health")
    def health() -> dict:
        return {"status": "alive"}

    @app.get("/ready")
    def ready() -> JSONResponse:
        return JSONResponse({"ready": False, "leader": leader() or None}, status_code=503)

    return app
