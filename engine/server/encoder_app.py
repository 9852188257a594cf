"""`tideflow serve --role encoder`: the vision encoder behind /internal/encode, with the content-hash cache.

The router's encoder LB sends a request's image data URLs here and passes the embeddings on to
prefill. One image at a time runs on the encoder (a lock), off the event loop; the number of
images waiting is what /internal/stats reports as `queued` for the LB.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading

import torch
from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from engine.encoder.cache import EncoderCache
from engine.encoder.images import ImageError
from engine.encoder.prompt import EncodedImage
from engine.encoder.worker import EncoderWorker
from engine.runtime import tls
from engine.runtime.errors import TideflowError
from engine.api.auth import ApiKey, BearerAuth, KeySource
from engine.api.errors import APIError, error_response, install_error_handlers
from engine.api.limits import BodyLimit
from engine.telemetry.metrics import MetricFactory
from engine.telemetry.tracing import FASTAPI_OWN_TELEMETRY_OFF, TraceRequests

log = logging.getLogger(__name__)


MAX_IMAGES_PER_REQUEST = 32


class EncodeRequest(BaseModel):
    images: list[str] = Field(min_length=1, max_length=MAX_IMAGES_PER_REQUEST,
                              description="base64 data URLs (data:image/png;base64,...), in prompt order")


class EncodeResponse(BaseModel):
    images: list[EncodedImage] = Field(description="one per requested image, in order")
    cache_hits: int = Field(ge=0, description="images of this request served from the cache")


class EncoderService:
    """Serialises encoder runs and counts the images waiting for them."""

    def __init__(self, worker: EncoderWorker) -> None:
        self.worker = worker
        self.queued = 0
        self.ready = False
        self._run_lock = threading.Lock()
        self._count_lock = threading.Lock()

    def admit(self, n: int) -> None:
        with self._count_lock:
            self.queued += n

    def _done(self, n: int) -> None:
        with self._count_lock:
            self.queued -= n

    def encode(self, urls: list[str]) -> EncodeResponse:
        """Embeddings of every admitted image, in order; a bad image fails the request with its index."""
        out, hits, left = [], 0, len(urls)
        try:
            for i, url in enumerate(urls):
                try:
                    with self._run_lock:
                        before = self.worker.cache.hits
                        vectors, digest = self.worker.encode(url)
                        hits += self.worker.cache.hits - before
                except ImageError as exc:
                    raise APIError(400, f"images[{i}]: {exc}", param="images", code="invalid_image") from None
                left -= 1
                self._done(1)
                out.append(EncodedImage.of(vectors, digest))
        finally:
            self._done(left)
        return EncodeResponse(images=out, cache_hits=hits)

    def warm_up(self) -> None:
        size = self.worker.encoder.config.image_size
        self.worker.encoder(torch.zeros(1, 3, size, size, device=self.worker.device))
        self.ready = True


def create_encoder_app(service: EncoderService, factory: MetricFactory, api_keys: list[str | ApiKey] | KeySource, *,
                       max_body_bytes: int, body_timeout_s: float) -> FastAPI:
    auth = BearerAuth(api_keys)
    app = FastAPI(title="tideflow encoder", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=FASTAPI_OWN_TELEMETRY_OFF)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, read_timeout_s=body_timeout_s)
    app.add_middleware(TraceRequests)  # outermost: its span covers the whole answer
    install_error_handlers(app)
    routes = APIRouter(dependencies=[Depends(auth)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "alive"}

    @routes.get("/ready")
    async def ready() -> JSONResponse:
        if not service.ready:
            return error_response(503, "the vision encoder is loading or warming up", code="not_ready")
        return JSONResponse({"status": "ready", "role": "encoder"})

    @routes.get("/internal/stats")
    async def stats() -> dict:
        return {"ready": service.ready, "queued": service.queued, "cached_images": len(service.worker.cache)}

    @routes.get("/metrics")
    async def metrics() -> Response:
        body, content_type = factory.render()
        return Response(body, media_type=content_type)

    @routes.post("/internal/encode")
    async def encode(body: EncodeRequest) -> EncodeResponse:
        if not service.ready:
            raise APIError(503, "the vision encoder is warming up; retry shortly", code="not_ready")
        service.admit(len(body.images))
        return await asyncio.to_thread(service.encode, body.images)

    app.include_router(routes)
    return app


def serve_encoder(args: argparse.Namespace) -> int:
    """The encoder role of `tideflow serve`: loads `<model>/vision_encoder/`, serves until stopped."""

    from engine.encoder.vision import load_vision_encoder
    from engine.api.auth import key_source
    from engine.api.connection_limits import from_args

    try:
        keys = key_source(args.api_key_file)  # the key file read again when it changes: keys rotate
        factory = MetricFactory(group=args.metrics_group, version=args.metrics_version, role="encoder")
        encoder = load_vision_encoder(args.model, args.device or "cpu")
        service = EncoderService(EncoderWorker(encoder, EncoderCache(registry=factory.registry)))
        service.warm_up()
    except (TideflowError, OSError, ValueError) as exc:
        print(f"tideflow serve: {exc}", file=sys.stderr)
        return 1
    log.info("serving the vision encoder on %s://%s:%d (%d patches per image)", tls.scheme(), args.host, args.port,
             encoder.config.num_patches)
    from engine.api.limits import MEMBER_KEEP_ALIVE_S

    from engine.api.connections import run_server

    limits = from_args(args)
    app = create_encoder_app(service, factory, keys, max_body_bytes=args.max_body_bytes,
                             body_timeout_s=limits.body_timeout_s)
    run_server(app, limits, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=MEMBER_KEEP_ALIVE_S,
               identity=args.identity, mutual=args.mutual)
    return 0
