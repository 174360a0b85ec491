"""What the routes share: the app's configuration, the client, the caller and its scopes, and the
checks and documentation common to several routes."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from bus.client import Client
from bus.goal_index import GoalIndex
from bus.schemas import GOAL_ID_PATTERN

from . import models as m
from .auth import SCOPES, Principal, TokenBook
from .errors import ApiError

STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
# application/json, with parameters (charset) or not, and structured syntaxes such as application/merge-patch+json.
JSON_MEDIA_TYPE = re.compile(r"^application/(?:[\w.-]+\+)?json$")


@dataclass
class ApiConfig:
    tokens: TokenBook = field(default_factory=lambda: TokenBook({}))
    insecure_local: bool = False  # every request acts as `local` with every scope (loopback only)
    max_body: int = 256 * 1024
    body_timeout: float = 10.0  # seconds a request body may take to arrive (TASKLOOM_API_BODY_TIMEOUT)
    ready_requires_workers: bool = False  # /readyz fails while a role has no live worker
    scan_limit: int = 2000  # index entries one filtered page of goals looks at
    # The model aliases a goal may name (`model`), from the models file the workers read; None: not
    # checked here (the workers refuse an alias they lack, failing the goal with the reason).
    model_aliases: frozenset[str] | None = None


# -- what the app holds (app.state, set by create_app and its lifespan) ------------------------------


def _config(request: Request) -> ApiConfig:
    config: ApiConfig = request.app.state.api_config
    return config


def _client(request: Request) -> Client:
    client: Client = request.app.state.client
    return client


def _index(request: Request) -> GoalIndex:
    index: GoalIndex = request.app.state.index
    return index


def _draining(request: Request) -> asyncio.Event:
    draining: asyncio.Event = request.app.state.draining
    return draining


Config = Annotated[ApiConfig, Depends(_config)]
ClientDep = Annotated[Client, Depends(_client)]
IndexDep = Annotated[GoalIndex, Depends(_index)]
Draining = Annotated[asyncio.Event, Depends(_draining)]


# -- auth -------------------------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="an API token (`taskloom api-token`)")


def principal(
    request: Request,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    config: ApiConfig = request.app.state.api_config
    if config.insecure_local:
        _same_machine_only(request)
        return Principal("local", frozenset(SCOPES))
    token = creds.credentials if creds is not None else None
    # EventSource cannot send headers: event streams also take the token as `access_token`.
    if token is None and request.url.path.endswith(("/events", "/stream")):
        token = request.query_params.get("access_token")
    if not token:
        raise ApiError(401, "unauthorized", "an API token is required: send `Authorization: Bearer <token>`")
    who = config.tokens.check(token)
    if who is None:
        raise ApiError(401, "unauthorized", "unknown API token")
    return who


_LOOPBACK_HOST = re.compile(r"^(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d+)?$")


def _same_machine_only(request: Request) -> None:
    """Without tokens, a web page from elsewhere must not drive the API through the user's browser:
    the Host must be a loopback name (no DNS rebinding) and a browser's Origin, if sent, this one."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if not _LOOPBACK_HOST.match(host) or (origin is not None and origin != f"http://{host}"):
        raise ApiError(403, "forbidden", "--insecure-local answers only same-origin requests to a loopback address")


def need(scope: str) -> Callable[[Principal], Principal]:
    def check(who: Annotated[Principal, Depends(principal)]) -> Principal:
        if not who.allows(scope):
            raise ApiError(403, "forbidden", f"token {who.name!r} lacks the {scope!r} scope")
        return who

    return check


Caller = Annotated[Principal, Depends(principal)]
Reader = Annotated[Principal, Depends(need("read"))]
Submitter = Annotated[Principal, Depends(need("submit"))]
Approver = Annotated[Principal, Depends(need("approve"))]


# -- inputs -----------------------------------------------------------------------------------------


async def _json_only(request: Request) -> None:
    """A request body must be JSON: curl's `-d` sends form encoding, which would otherwise be
    reported as a wrong body shape. No Content-Type at all is read as JSON (as FastAPI does)."""
    given = request.headers.get("content-type")
    if given is None or not await request.body():
        return
    if not JSON_MEDIA_TYPE.match(given.split(";", 1)[0].strip().lower()):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type: the body must be JSON, sent with `Content-Type: application/json` (got {given!r})",
            "Content-Type",
        )


JsonBody = Annotated[None, Depends(_json_only)]
GoalIdPath = Annotated[str, Path(description="the goal id", max_length=64)]

# The answers of a route that reads a body, besides its own.
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    408: {"model": m.ErrorBody, "description": "the body did not arrive in time (the connection is closed)"},
    413: {"model": m.ErrorBody, "description": "the body is over the limit"},
    415: {"model": m.ErrorBody, "description": "the body is not sent as JSON; `field` is Content-Type"},
}


def goal_id_of(goal_id: str) -> str:
    """A goal id as given in a path; one no goal can have is a 404 at once."""
    if not re.match(GOAL_ID_PATTERN, goal_id):
        raise ApiError(404, "not_found", f"goal {goal_id!r} not found")
    return goal_id


def position(value: str | None, name: str) -> str | None:
    """A stream position given as `name` (None when not given)."""
    if value is None or value == "":
        return None
    if not STREAM_ID.match(value):
        raise ApiError(422, "invalid_request", f"{name}: expected a stream position such as 1700000000000-0", name)
    return value
