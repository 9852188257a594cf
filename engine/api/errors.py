"""OpenAI-style error objects and the handlers that turn every failure into one."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.core.admission import EngineError
from engine.api.limits import BodyReadTimeout
from engine.api.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for a request its client abandoned; never reaches the gone client

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list"}


class APIError(Exception):
    """Raised by routes; answered as {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


ECHO_CHARS = 200  # of a client's input quoted back in an error: a 2 MB model id is not answered with itself
MAX_MESSAGE_CHARS = 2000  # backstop for a message that quotes more than it should


def clip(value: object) -> str:
    """`value` as an error quotes it: repr, at most ECHO_CHARS characters."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]}... (cut)"
    body = ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The first pydantic error as (message naming the field, param)."""
    # a union reports one error per member type: the deepest is the one about what the client meant
    # (prompt.list[int].0 "less than 2^31" rather than prompt "a valid string")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    # union members add their type's name to the location (prompt.list[int].0): keep the field path
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _TYPE_TAGS and "[" not in str(p)]
    param = ".".join(loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def invalid(exc: ValidationError) -> APIError:
    """The 400 for a body pydantic refused. Its errors are read without their `input`: for a body validated from
    JSON that would rebuild the refused value as Python objects (10^5 dicts for a too-long `messages`), in one
    call with the GIL held, on whichever thread answers."""
    message, param = validation_message(exc.errors(include_input=False, include_url=False))
    return APIError(400, message, param, "invalid_value")


def install_error_handlers(app: FastAPI, on_error=None) -> None:
    """`on_error(status)` is called for every error answered (metrics)."""

    def answer(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        if on_error is not None:
            on_error(status)
        return error_response(status, message, param, code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return answer(400, message, param, "invalid_value")

    @app.exception_handler(ValidationError)
    async def _invalid_params(request: Request, exc: ValidationError) -> JSONResponse:
        refused = invalid(exc)
        return answer(refused.status, refused.message, refused.param, refused.code)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return answer(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return answer(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(exc.status_code, str(exc.detail))

    @app.exception_handler(BodyReadTimeout)
    async def _stalled(request: Request, exc: BodyReadTimeout) -> JSONResponse:
        log.info("client %s: %s (%s)", _peer(request), exc.detail, request.url.path)
        return answer(408, exc.detail, code="request_timeout")

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # a client that hangs up mid-body is routine, not a server error: one line, not a traceback per client
        log.info("client %s hung up before its request body to %s was read", _peer(request), request.url.path)
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return answer(500, "internal server error; the server log has the details")


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "(unknown)"
