"""Every error the API answers is `{"error": {"type", "message", "field"}}`, never a stack trace."""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from bus.approvals import AlreadyDecided
from bus.connection import UNREACHABLE
from bus.store import NotFound

from . import models as m

log = structlog.get_logger("taskloom.api")


class ApiError(Exception):
    """An error answered as `{"error": {"type", "message", "field"}}` with `status`."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field


def error_response(
    status: int, type_: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = m.ErrorBody(error=m.ErrorDetail(type=type_, message=message, field=field))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_STATUS_TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
}


def _field_of(loc: tuple[Any, ...]) -> str | None:
    # FastAPI locations start with where the value came from: body, query, path, header.
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or None


def _validation_response(errors: list[Any]) -> JSONResponse:
    first = errors[0] if errors else {"loc": (), "msg": "invalid input"}
    fld = _field_of(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid input"))
    if first.get("type") == "json_invalid":
        msg = "the body is not valid JSON"
        fld = None
    message = f"{fld}: {msg}" if fld else msg
    more = len(errors) - 1
    if more > 0:
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return error_response(422, "invalid_request", message, fld)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return error_response(exc.status, exc.type, exc.message, exc.field, headers)


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _validation_response(list(exc.errors()))


async def _invalid_model(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return _validation_response(list(exc.errors(include_url=False)))


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    type_ = _STATUS_TYPES.get(exc.status_code, "error")
    message = str(exc.detail) if exc.status_code != 404 else "no such resource"
    return error_response(exc.status_code, type_, message, headers=getattr(exc, "headers", None))


async def _not_found(_: Request, exc: Exception) -> JSONResponse:
    decided = isinstance(exc, AlreadyDecided)
    return error_response(409 if decided else 404, "conflict" if decided else "not_found", str(exc))


async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
    log.warning("api.redis_unreachable", error=repr(exc))
    return error_response(503, "unavailable", "Redis is unreachable; try again", headers={"Retry-After": "2"})


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("api.error", path=request.url.path)
    return error_response(500, "internal", "internal error (logged)")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(ValidationError, _invalid_model)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(NotFound, _not_found)
    for kind in UNREACHABLE:
        app.add_exception_handler(kind, _redis_down)
    app.add_exception_handler(Exception, _bug)
