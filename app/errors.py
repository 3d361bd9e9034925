"""One error envelope for every error, and the one table mapping domain errors to status codes."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.schemas.common import ErrorEnvelope
from core.auth import Unauthorized
from core.errors import (
    BrokerUnavailable,
    Conflict,
    DomainError,
    NotFound,
    PayloadTooLarge,
    QueueTimeout,
    StorageUnavailable,
    TooManyRequests,
    UpstreamFailed,
    ValidationFailed,
    WorkerTimeout,
)
from core.jobspec import field_of
from core.protocol import ErrorBody, ErrorCode, error_body

log = logging.getLogger(__name__)

STATUS_FOR: dict[type[DomainError], int] = {
    Unauthorized: 401,
    TooManyRequests: 429,
    ValidationFailed: 422,
    NotFound: 404,
    Conflict: 409,
    PayloadTooLarge: 413,
    BrokerUnavailable: 503,
    QueueTimeout: 503,
    StorageUnavailable: 503,
    UpstreamFailed: 502,
    WorkerTimeout: 504,
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorEnvelope, "description": cls.__doc__ or cls.__name__}
    for cls, status in STATUS_FOR.items()
}


envelope = error_body  # the one builder of the error body (REST, SSE error events, job rows)


def from_wire(error: ErrorBody) -> DomainError:
    """A worker's error (a protocol ErrorBody) as the domain error the API answers with: the one mapping."""
    code, message, field = error.code, error.message or "the worker failed", error.field
    if code == ErrorCode.VALIDATION_ERROR:
        return ValidationFailed(field, message)
    if code == ErrorCode.QUEUE_TIMEOUT:
        return QueueTimeout(message)
    if code == ErrorCode.OVERLOADED:
        return TooManyRequests(message, retry_after=1, code=ErrorCode.OVERLOADED)
    if code == ErrorCode.WORKER_TIMEOUT:
        return WorkerTimeout(message)
    if code == ErrorCode.BROKER_UNAVAILABLE:
        return BrokerUnavailable(message)
    return UpstreamFailed(message, code=code or ErrorCode.WORKER_ERROR)


def status_for(exc: DomainError) -> int:
    """Look a domain error up in the table (most specific class first)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_FOR:
            return STATUS_FOR[cls]  # type: ignore[index]
    return 400


def _loc_to_field(loc: tuple[Any, ...], ctx: Any = None) -> str | None:
    """The dotted field of a validation error: without the request part or a job-kind tag (a union member),
    with the member a discriminator names (`ctx.field`, core.jobspec)."""
    return field_of(tuple(p for p in loc if p not in ("body", "query", "path", "header", "form")), ctx)


def domain_headers(exc: DomainError) -> dict[str, str]:
    """Headers that go with an error: Retry-After on 429, WWW-Authenticate on 401."""
    if isinstance(exc, TooManyRequests):
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    if isinstance(exc, Unauthorized):
        return {"WWW-Authenticate": "Bearer"}
    if isinstance(exc, (QueueTimeout, BrokerUnavailable)):
        return {"Retry-After": "5"}
    return {}


def respond(request: Request, status: int, content: dict[str, Any], headers: dict[str, str] | None = None
            ) -> JSONResponse:
    """The error response; on OpenAI's /v1 routes the body also carries OpenAI's `type` and `param` (the field),
    so official clients read every field they expect."""
    if request.url.path.startswith("/v1/"):
        body = content["error"]
        body["param"] = body.get("field")
        body["type"] = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse(status_code=status, content=content, headers=headers)


async def _domain(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DomainError)
    return respond(request, status_for(exc), exc.envelope(), domain_headers(exc))


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _loc_to_field(tuple(first.get("loc", ())), first.get("ctx"))
    details = [{"field": _loc_to_field(tuple(e.get("loc", ())), e.get("ctx")), "message": e.get("msg"),
                "type": e.get("type")} for e in errors]
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return respond(request, 422, envelope(ErrorCode.VALIDATION_ERROR, message, field, details))


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED,
            413: ErrorCode.PAYLOAD_TOO_LARGE}.get(exc.status_code, ErrorCode.HTTP_ERROR)
    field = None
    if exc.status_code == 400:  # the framework could not parse the body (e.g. a JSON integer of 5,000 digits)
        code, field = ErrorCode.VALIDATION_ERROR, "body"
    return respond(request, exc.status_code, envelope(code, str(exc.detail), field), getattr(exc, "headers", None))


async def _database_down(request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", type(exc).__name__)
    return respond(request, 503, envelope(ErrorCode.DATABASE_UNAVAILABLE, "the database is unavailable; retry "
                                          "shortly"), {"Retry-After": "5"})


async def _bad_data(request: Request, exc: Exception) -> JSONResponse:
    # Last line of defence: input the database refuses (e.g. NUL in text) is the client's error, not ours.
    log.warning("database refused a value: %s", type(exc).__name__)
    return respond(request, 422, envelope(ErrorCode.VALIDATION_ERROR, "a value contains characters or a size the "
                                                                       "database cannot store"))


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return respond(request, 500, envelope(ErrorCode.INTERNAL_ERROR, "internal server error"))


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through the envelope."""
    app.add_exception_handler(DomainError, _domain)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(DataError, _bad_data)
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(InterfaceError, _database_down)
    app.add_exception_handler(PoolTimeout, _database_down)  # every pooled connection busy for pool_timeout
    app.add_exception_handler(Exception, _unhandled)
