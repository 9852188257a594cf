"""The gateway: OpenAI API in front of a group set. Its groups come from the controller (`controller_url`:
it watches the route set), or, standalone, from the admin API a group manager pushes to."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import time
from urllib.parse import urlsplit
from contextlib import asynccontextmanager

import httpx
from typing import Annotated, Callable

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field, ValidationError

from engine.runtime.errors import TideflowError
from engine.runtime.http import bearer_async_client
from engine.router.config import RouterConfig
from engine.router.health import HealthMonitor
from engine.router.kv_index import KVIndex
from engine.router.metrics import RouterMetrics
from engine.api.cpu_pool import INLINE_BYTES, CpuPool
from engine.router.prompt import PromptPreparer
from engine.router.proxy import Proxy
from engine.router.ratelimit import RateLimiter
from engine.router.samples import SamplePage
from engine.router.sync import ROUTES_KEY_ENV, ControllerSync
from engine.router.registry import GROUP_NAME_PATTERN, GroupName, GroupRegistration, Registry, Weight
from engine.api.auth import RECHECK_S, ApiKey, BearerAuth, KeySource, bearer_token, key_digest, key_state, publish_openapi
from engine.api.limits import BodyLimit
from engine.api.errors import APIError, clip, error_response, install_error_handlers, invalid
from engine.api.requests import check_chat_size, check_priority
from engine.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from engine.telemetry.tracing import FASTAPI_OWN_TELEMETRY_OFF, TraceRequests

UPSTREAM_KEY_ENV = "TIDEFLOW_UPSTREAM_API_KEY"
ADMIN_KEYS_ENV = "TIDEFLOW_ADMIN_KEYS"
MAX_SAMPLES_PAGE = 20_000


class RouterConfigError(TideflowError):
    """The router cannot start as configured."""


class WeightsUpdate(BaseModel):
    weights: dict[GroupName, Weight] = Field(description="group name -> traffic weight (finite, >= 0)")


def create_router_app(config: RouterConfig, api_keys: list[str | ApiKey] | KeySource, admin_keys: list[str],
                      upstream_key: str | Callable[[], str] | None = None,
                      routes_key: str | Callable[[], str] | None = None) -> FastAPI:
    """`upstream_key`: the key this router sends to members; `routes_key`: the one it sends to
    `config.controller_url` to watch the route set. Either may be a callable (engine.api.auth.secret_from_env):
    a key rotated in its file is followed without a restart."""
    upstream_key = (lambda key=upstream_key: key) if isinstance(upstream_key, str) else upstream_key
    routes_key = (lambda key=routes_key: key) if isinstance(routes_key, str) else routes_key
    if not admin_keys:
        raise RouterConfigError(f"the router's admin API needs a key: set {ADMIN_KEYS_ENV} (comma-separated)")
    if config.controller_url and not routes_key:
        raise RouterConfigError(f"--controller-url needs the controller's routes key in ${ROUTES_KEY_ENV}")
    registry = Registry()
    metrics = RouterMetrics()
    auth, admin_auth = BearerAuth(api_keys), BearerAuth(admin_keys)
    limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst) if config.rate_limit_rps else None
    preparer = PromptPreparer(config.model_dir) if config.model_dir else None
    cpu = CpuPool(config.prompt_workers, config.prompt_queue)
    headers = {"authorization": f"Bearer {upstream_key()}"} if upstream_key else {}  # followed below
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Idle upstream connections expire here well before the members' keep-alive timeout closes
        # them, so a request is never sent on a socket the server is closing (a spurious ReadError).
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
        async with bearer_async_client(upstream_key() if upstream_key else None, limits=limits) as client:
            kv_index = KVIndex() if config.kv_routing.mode == "precise" else None
            monitor = HealthMonitor(registry, client, config.health_interval_s, config.eject_after, config.readmit_after,
                                    kv_index)
            state["proxy"] = Proxy(config, registry, client, metrics, preparer.prepare if preparer else _no_pd, headers,
                                   cpu, kv_index or KVIndex())
            sync = None
            if config.controller_url:
                sync = ControllerSync(registry, config.controller_url, routes_key,
                                      config.advertise or f"{config.host}:{config.port}", accept=outside_networks,
                                      url=config.replica_url, key_state=lambda: key_state(
                                          auth.source.keys(), routes_key(), upstream_key() if upstream_key else ""))
                sync.start()
            monitor.start()
            follower = asyncio.create_task(_follow_upstream_key(upstream_key, headers, client)) if upstream_key else None
            try:
                yield
            finally:
                if follower is not None:
                    follower.cancel()
                await monitor.stop()
                if sync is not None:
                    await sync.stop()
                cpu.close()

    app = FastAPI(title="tideflow router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=FASTAPI_OWN_TELEMETRY_OFF)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, read_timeout_s=config.connections.body_timeout_s)
    app.add_middleware(TraceRequests)  # outermost: its span covers the whole answer
    publish_openapi(app, admin_auth)
    install_error_handlers(app)

    def outside_networks(reg: GroupRegistration) -> str | None:
        if config.member_networks is not None:
            outside = [e.url for e in reg.endpoints if not in_networks(e.url, config.member_networks)]
            if outside:
                return f"{outside[0]} is outside the member networks this router accepts"
        return None

    async def writable() -> None:  # async dependencies: no thread-pool hop per request
        if config.controller_url:
            raise APIError(409, f"this router takes its groups from the controller at {config.controller_url}; "
                                "change them there")

    async def client_key(request: Request) -> None:
        auth.check(request)
        if limiter is not None:
            key = bearer_token(request) or "anonymous"  # one bucket per key
            if not limiter.allow(key):
                metrics.rate_limited.inc()
                raise APIError(429, "rate limit reached for this API key; slow down and retry", code="rate_limit_exceeded")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "alive"}

    @app.get("/ready")  # open like /health: Kubernetes probes carry no secrets
    async def ready() -> JSONResponse:
        routable = [g.reg.name for g in registry.groups() if g.routable]
        return JSONResponse({"ready": bool(routable), "groups": routable}, status_code=200 if routable else 503)

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def prom() -> Response:
        metrics.refresh(registry.groups())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/samples", dependencies=[Depends(auth)])
    async def samples(after: Annotated[int, Query(ge=0)] = 0,
                      group: Annotated[list[str] | None, Query(max_length=64)] = None,
                      limit: Annotated[int, Query(ge=0, le=MAX_SAMPLES_PAGE)] = MAX_SAMPLES_PAGE) -> SamplePage:
        """Per-request outcomes numbered above `after`, of the named groups (all by default), oldest first."""
        return metrics.samples.page(after, set(group) if group else None, limit)

    @app.get("/v1/models", dependencies=[Depends(client_key)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=config.model_name)])

    async def forward(request: Request, api: str, model_cls) -> Response:
        raw = await request.body()
        if len(raw) < INLINE_BYTES:
            parsed, body = _parse(model_cls, raw)
        else:
            parsed, body = await cpu.run(_parse, model_cls, raw)
        if parsed.model != config.model_name:
            return error_response(404, f"model {clip(parsed.model)} does not exist; this router serves "
                                       f"{config.model_name!r}", "model", "model_not_found")
        check_priority(parsed.priority, auth.priority_floor(request))
        token = bearer_token(request) if auth.enabled else None  # without keys, a bearer value is anybody's word
        return await state["proxy"].serve(api, body, raw, key_digest(token) if token else "")

    @app.post("/v1/completions", dependencies=[Depends(client_key)])
    async def completions(request: Request) -> Response:
        return await forward(request, "completions", CompletionRequest)

    @app.post("/v1/chat/completions", dependencies=[Depends(client_key)])
    async def chat(request: Request) -> Response:
        return await forward(request, "chat/completions", ChatCompletionRequest)

    @app.get("/admin/groups", dependencies=[Depends(admin_auth)])
    async def list_groups() -> dict:
        return {"groups": [g.summary() for g in registry.groups()]}

    @app.get("/admin/kv-index", dependencies=[Depends(admin_auth)])
    async def kv_index_now() -> dict:
        """What this router knows of the KV each member holds, and how its placements were made."""
        proxy = state["proxy"]
        return {"mode": config.kv_routing.mode, "choices": proxy.kv_router.choices,
                "members": proxy.kv_router.index.summary(time.monotonic())}

    @app.post("/admin/groups", dependencies=[Depends(admin_auth), Depends(writable)])
    async def register(reg: GroupRegistration) -> dict:
        refused = outside_networks(reg)
        if refused:
            raise APIError(400, refused, "endpoints")
        registry.register(reg)
        return {"registered": reg.name}

    @app.delete("/admin/groups/{name}", dependencies=[Depends(admin_auth), Depends(writable)])
    async def deregister(name: Annotated[str, Path(pattern=GROUP_NAME_PATTERN)]) -> dict:
        if not registry.deregister(name):
            raise APIError(404, f"no group named {name!r} is registered", "name")
        return {"deregistered": name}

    @app.put("/admin/weights", dependencies=[Depends(admin_auth), Depends(writable)])
    async def weights(update: WeightsUpdate) -> dict:
        try:
            registry.set_weights(update.weights)
        except (KeyError, ValueError) as exc:
            raise APIError(400, str(exc).strip("'\""), "weights") from None
        return {"weights": {g.reg.name: g.reg.weight for g in registry.groups()}}

    app.state.registry = registry
    return app


def in_networks(url: str, networks) -> bool:
    """The URL's host is an IP literal inside one of `networks` (or localhost, when loopback is allowed)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name could resolve anywhere: only literals are checked against the list
    return any(address in net for net in networks)


def _parse(model_cls, raw: bytes) -> tuple:
    """The validated request and the client's body as a dict (relayed as it came, unknown fields included); the
    400 for a body that does not validate is made here too, on the same thread (a chat body's size first:
    check_chat_size)."""
    if model_cls is ChatCompletionRequest:
        check_chat_size(raw)
    try:
        return model_cls.model_validate_json(raw), json.loads(raw)
    except ValidationError as exc:
        raise invalid(exc) from None


def _no_pd(api: str, body: dict) -> list[int]:
    raise APIError(500, "this router has no model_dir, so it cannot serve disaggregated groups")


async def _follow_upstream_key(current: Callable[[], str], headers: dict[str, str], client: httpx.AsyncClient) -> None:
    """The members' key as its file holds it now, in the headers every upstream request takes (a rotation)."""
    while True:
        await asyncio.sleep(RECHECK_S)
        value = f"Bearer {current()}"
        if headers.get("authorization") != value:
            headers["authorization"] = value
            client.headers["authorization"] = value


def keys_from_env(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]
