"""The HTTP API and web console: an ASGI app (FastAPI) over `bus.client.Client`.

It keeps no state of its own: every request reads or writes Redis through the client, so an API
process can be killed or scaled out at any time and nothing is lost. Event streams are
server-sent events whose ids are stream positions, so a client that reconnects with
`Last-Event-ID` resumes exactly where it stopped, on any API process.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Annotated, Any

import structlog
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from opentelemetry.trace import SpanKind
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import bus.tracing as tracing
from bus.approvals import AlreadyDecided
from bus.client import Client
from bus.connection import UNREACHABLE
from bus.goal_index import BadCursor, GoalIndex
from bus.ledger import LedgerNotFound, LedgerSnapshot
from bus.replies import as_str
from bus.schemas import GOAL_ID_PATTERN, Event, GoalState, TaskResult
from bus.store import AlreadyExists, IllegalTransition, NotFound
from bus.tenants import TenantView
from planner.dag import render_json, render_mermaid

from .. import health
from ..metrics import REGISTRY
from . import models as m
from .auth import SCOPES, Principal, TokenBook

log = structlog.get_logger("taskloom.api")

STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
KEEPALIVE_S = 15.0
# application/json, with parameters (charset) or not, and structured syntaxes such as application/merge-patch+json.
JSON_MEDIA_TYPE = re.compile(r"^application/(?:[\w.-]+\+)?json$")
# A stream cut by a shutdown asks its client to come back this soon (on another API process, or this one restarted).
SHUTDOWN_RETRY_MS = 1000

API_REQUESTS = Counter(
    "taskloom_api_requests",
    "API requests by route template, method and status",
    ["route", "method", "status"],
    registry=REGISTRY,
)
API_LATENCY = Histogram(
    "taskloom_api_request_duration_seconds",
    "API request latency (event streams excluded)",
    ["route"],
    registry=REGISTRY,
)


class ApiError(Exception):
    """An error answered as `{"error": {"type", "message", "field"}}` with `status`."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field


def _error(
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
    return _error(422, "invalid_request", message, fld)


class RequestMetrics:
    """Count requests by route template and status (a pure ASGI wrapper: it leaves streaming alone)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # The router records the matched route in the scope; a template keeps the label bounded.
            template = getattr(scope.get("route"), "path", "(unmatched)")
            API_REQUESTS.labels(template, scope["method"], str(status)).inc()
            if not template.endswith("/events"):
                API_LATENCY.labels(template).observe(time.perf_counter() - started)


class BodyLimit:
    """Read the whole request body before the app sees it: refuse one over `limit` bytes with 413,
    and one that has not fully arrived within `timeout` seconds with 408 (closing the connection).

    A declared Content-Length over the limit is refused at once; a chunked body is counted as it
    arrives and refused once it passes the limit. The timeout covers a client that declares more
    than it sends, or trickles it: without it such a request holds its connection forever.
    """

    def __init__(self, app: ASGIApp, limit: int, timeout: float) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = _error(413, "payload_too_large", f"the request body is over the limit of {self.limit} bytes")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await _error(400, "invalid_request", "Content-Length is not a number", "Content-Length")(
                    scope, receive, send
                )
                return
            if n > self.limit:
                await too_big(scope, receive, send)
                return
        # Read the (small) body up to the limit, then replay it to the app.
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read(receive)
        except TimeoutError:
            late = f"the request body did not arrive within {self.timeout:g} s (TASKLOOM_API_BODY_TIMEOUT)"
            await _error(408, "request_timeout", late, headers={"Connection": "close"})(scope, receive, send)
            return
        if body is None:  # the client left
            return
        if len(body) > self.limit:
            await too_big(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body, or its first bytes past the limit; None if the client disconnected."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            chunks.append(chunk)
            if size > self.limit or not message.get("more_body", False):
                return b"".join(chunks)


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


_bearer = HTTPBearer(auto_error=False, description="an API token (`taskloom api-token`)")


def _goal_id(goal_id: str) -> str:
    if not re.match(GOAL_ID_PATTERN, goal_id):
        raise ApiError(404, "not_found", f"goal {goal_id!r} not found")
    return goal_id


GoalIdPath = Annotated[str, Path(description="the goal id", max_length=64)]


# -- auth -------------------------------------------------------------------------------------


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
    if token is None and request.url.path.endswith("/events"):
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


def drain(app: FastAPI) -> None:
    """The server is stopping: every open event stream sends its `shutdown` frame and ends."""
    app.state.draining.set()


def create_app(
    client_factory: Callable[[], contextlib.AbstractAsyncContextManager[Client]], config: ApiConfig
) -> FastAPI:
    """The app. `client_factory` opens the Redis client for the app's lifetime."""
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with client_factory() as client:
            state["client"] = client
            state["index"] = GoalIndex(client.redis, client.keys)
            yield

    app = FastAPI(
        title="taskloom",
        version="1",
        summary="Submit goals, follow them live, read plans and ledgers, decide tool calls awaiting approval.",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI would load scripts from a CDN; the document is at /openapi.json
        redoc_url=None,
        openapi_url="/openapi.json",
        responses={
            401: {"model": m.ErrorBody, "description": "no or unknown token"},
            403: {"model": m.ErrorBody, "description": "the token lacks the scope"},
            422: {"model": m.ErrorBody, "description": "invalid input; `field` names it"},
        },
    )
    body_errors: dict[int | str, dict[str, Any]] = {
        408: {"model": m.ErrorBody, "description": "the body did not arrive in time (the connection is closed)"},
        413: {"model": m.ErrorBody, "description": "the body is over the limit"},
        415: {"model": m.ErrorBody, "description": "the body is not sent as JSON; `field` is Content-Type"},
    }

    app.state.api_config = config
    app.state.draining = asyncio.Event()  # set by `drain`

    def client() -> Client:
        c: Client = state["client"]
        return c

    # -- errors: always {"error": {...}}, never a stack trace ----------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.type, exc.message, exc.field, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(list(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _invalid_model(_: Request, exc: ValidationError) -> JSONResponse:
        return _validation_response(list(exc.errors(include_url=False)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = _STATUS_TYPES.get(exc.status_code, "error")
        message = str(exc.detail) if exc.status_code != 404 else "no such resource"
        return _error(exc.status_code, type_, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return _error(
            409 if isinstance(exc, AlreadyDecided) else 404,
            "conflict" if isinstance(exc, AlreadyDecided) else "not_found",
            str(exc),
        )

    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("api.redis_unreachable", error=repr(exc))
        return _error(503, "unavailable", "Redis is unreachable; try again", headers={"Retry-After": "2"})

    for kind in UNREACHABLE:
        app.add_exception_handler(kind, _redis_down)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("api.error", path=request.url.path)
        return _error(500, "internal", "internal error (logged)")

    # -- goals --------------------------------------------------------------------------------

    @app.post(
        "/v1/goals",
        response_model=m.Submitted,
        status_code=201,
        tags=["goals"],
        responses={
            200: {"model": m.Submitted, "description": "already submitted under this Idempotency-Key"},
            409: {"model": m.ErrorBody, "description": "the Idempotency-Key was used for another goal"},
            **body_errors,
        },
    )
    async def submit(
        goal: m.GoalIn,
        who: Submitter,
        _: JsonBody,
        request: Request,
        response: Response,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                description="your id for this goal (letters, digits, _ and -, up to 64): "
                "re-sending the same request stores nothing new and returns the same goal id",
            ),
        ] = None,
    ) -> m.Submitted:
        """Submit a goal; it is planned and run by the workers."""
        c = client()
        aliases = config.model_aliases
        if goal.model is not None and aliases is not None and goal.model not in aliases:
            known = ", ".join(sorted(aliases)) or "none (no models file)"
            raise ApiError(422, "invalid_request", f"model: {goal.model!r} is no configured alias ({known})", "model")
        if idempotency_key is not None and not re.match(GOAL_ID_PATTERN, idempotency_key):
            raise ApiError(
                422, "invalid_request", "Idempotency-Key: use 1 to 64 letters, digits, _ or -", "Idempotency-Key"
            )
        try:
            # A caller's W3C `traceparent` header: the goal joins the caller's trace (bus.tracing).
            with tracing.span("POST /v1/goals", kind=SpanKind.SERVER, parent=request.headers.get("traceparent")):
                # The store's atomic create decides `created`: of concurrent requests with one key, one wins.
                gid, created = await c.submit_once(goal.to_goal(), goal_id=idempotency_key)
        except AlreadyExists:
            raise ApiError(
                409,
                "conflict",
                f"Idempotency-Key {idempotency_key!r} was already used for a different goal",
                "Idempotency-Key",
            ) from None
        log.info("api.submitted", goal_id=gid, by=who.name, replay=not created)
        if not created:
            response.status_code = 200
        return m.Submitted(goal_id=gid, created=created)

    @app.get("/v1/goals", response_model=m.GoalList, tags=["goals"])
    async def list_goals(
        _: Reader,
        state_: Annotated[
            list[GoalState] | None, Query(alias="state", description="repeatable: any of these states")
        ] = None,
        cursor: Annotated[str | None, Query(max_length=200, description="from the previous page's next_cursor")] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> m.GoalList:
        """Goals, newest first, optionally filtered by state; page with `cursor`."""
        try:
            page = await state["index"].page(state_, cursor, limit, config.scan_limit)
        except BadCursor as exc:
            raise ApiError(422, "invalid_request", str(exc), "cursor") from None
        rows = await asyncio.gather(*(_summary(client(), gid) for gid in page.ids))
        return m.GoalList(goals=[r for r in rows if r is not None], next_cursor=page.next_cursor)

    @app.get(
        "/v1/goals/{goal_id}", response_model=m.GoalStatusOut, tags=["goals"], responses={404: {"model": m.ErrorBody}}
    )
    async def goal_status(goal_id: GoalIdPath, _: Reader) -> m.GoalStatusOut:
        """A goal's state, answer, current plan and every task's state."""
        s = await client().status(_goal_id(goal_id))
        return m.GoalStatusOut(goal=s.goal, plan=s.plan, tasks=s.tasks)

    @app.get(
        "/v1/goals/{goal_id}/plan", response_model=m.PlanOut, tags=["goals"], responses={404: {"model": m.ErrorBody}}
    )
    async def goal_plan(
        goal_id: GoalIdPath,
        _: Reader,
        version: Annotated[int | None, Query(ge=1, description="default: current")] = None,
    ) -> m.PlanOut:
        """The DAG of the current (or a given) plan version, with each task's state, in JSON and Mermaid."""
        c = client()
        await c.get(_goal_id(goal_id))
        stored = await c.store.get_plan(goal_id, version)
        states = {tid: t.state for tid, t in (await c.store.get_tasks(goal_id)).items()}
        return m.PlanOut.model_validate(
            {
                "goal_id": goal_id,
                "version": stored.version,
                "reason": stored.reason,
                **render_json(stored.plan, states),
                "mermaid": render_mermaid(stored.plan, states),
            }
        )

    @app.get(
        "/v1/goals/{goal_id}/ledger",
        response_model=LedgerSnapshot,
        tags=["goals"],
        responses={404: {"model": m.ErrorBody}},
    )
    async def goal_ledger(goal_id: GoalIdPath, _: Reader) -> LedgerSnapshot:
        """The goal's token budget: spent by kind, reserved, calls, cost and headroom."""
        c = client()
        await c.get(_goal_id(goal_id))
        try:
            snap = await c.ledger.snapshot(goal_id)
        except LedgerNotFound:
            raise ApiError(404, "not_found", f"goal {goal_id!r} has no ledger") from None
        return snap

    @app.get(
        "/v1/tenants/{name}",
        response_model=TenantView,
        tags=["tenants"],
        responses={422: {"model": m.ErrorBody}},
    )
    async def tenant(name: str, _: Reader) -> TenantView:
        """A tenant's pool settings, running tasks and spend by period, model and kind (bus.tenants)."""
        try:
            return await client().tenant_show(name)
        except ValueError as exc:
            raise ApiError(422, "invalid_request", str(exc), "name") from None

    @app.get(
        "/v1/goals/{goal_id}/attempts",
        response_model=m.AttemptsOut,
        tags=["goals"],
        responses={404: {"model": m.ErrorBody}},
    )
    async def goal_attempts(goal_id: GoalIdPath, _: Reader) -> m.AttemptsOut:
        """Each task's attempts: the answer, how it stopped, its usage and the critic's verdict."""
        return await _attempts(client(), _goal_id(goal_id))

    @app.post(
        "/v1/goals/{goal_id}/cancel",
        response_model=m.Cancelled,
        tags=["goals"],
        responses={
            404: {"model": m.ErrorBody},
            409: {"model": m.ErrorBody, "description": "the goal already ended (cancelled included)"},
            **body_errors,
        },
    )
    async def cancel(
        goal_id: GoalIdPath, who: Submitter, _: JsonBody, body: m.CancelIn | None = None
    ) -> m.Cancelled:
        """Cancel a goal and its unfinished tasks; a goal that already ended, cancelled included, is a 409."""
        reason = (body or m.CancelIn()).reason
        try:
            changed = await client().cancel(_goal_id(goal_id), f"{reason} (by {who.name})")
        except IllegalTransition as exc:
            changed, ended = False, exc.current
        else:
            ended = GoalState.CANCELLED.value
        if not changed:
            # One rule for every ended goal, cancelled included: whoever cancelled first got the 200.
            raise ApiError(409, "conflict", f"goal {goal_id} already ended ({ended}); nothing to cancel")
        log.info("api.cancelled", goal_id=goal_id, by=who.name)
        return m.Cancelled(goal_id=goal_id, changed=True)

    # -- events -------------------------------------------------------------------------------

    sse_doc: dict[int | str, dict[str, Any]] = {
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": "server-sent events: `id` is the stream position, `data` an Event as JSON; "
            "an `end` event when the goal has ended; a `shutdown` event (with `retry`) when the server "
            "stops: reconnect with Last-Event-ID",
        }
    }

    @app.get(
        "/v1/goals/{goal_id}/events",
        response_class=StreamingResponse,
        tags=["events"],
        responses={**sse_doc, 404: {"model": m.ErrorBody}},
    )
    async def goal_events(
        goal_id: GoalIdPath,
        _: Reader,
        last_event_id: Annotated[
            str | None, Header(alias="Last-Event-ID", description="resume after this position")
        ] = None,
        after: Annotated[str | None, Query(description="resume after this position (as Last-Event-ID)")] = None,
        access_token: Annotated[str | None, Query(description="the token, for EventSource (no headers)")] = None,
    ) -> StreamingResponse:
        """The goal's events from the start (or after a position), live, until the goal ends."""
        c = client()
        await c.get(_goal_id(goal_id))
        start = _position(last_event_id, "Last-Event-ID") or _position(after, "after")
        return _sse(_follow(c, goal_id, start), app.state.draining)

    @app.get("/v1/events", response_class=StreamingResponse, tags=["events"], responses=sse_doc)
    async def all_events(
        _: Reader,
        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
        after: Annotated[str | None, Query(description="position, or `$` for new events only")] = None,
        access_token: Annotated[str | None, Query(description="the token, for EventSource (no headers)")] = None,
    ) -> StreamingResponse:
        """Every goal's events, live (the console's goals table follows this); never ends."""
        start = _position(last_event_id, "Last-Event-ID") or (after if after == "$" else _position(after, "after"))
        if start == "$":
            tail = await client().redis.xrevrange(client().keys.global_events(), count=1)
            start = as_str(tail[0][0]) if tail else "0-0"
        return _sse(_follow(client(), None, start), app.state.draining)

    # -- approvals ----------------------------------------------------------------------------

    @app.get("/v1/approvals", response_model=m.ApprovalList, tags=["approvals"])
    async def approvals(
        _: Reader,
        goal_id: Annotated[str | None, Query(max_length=64, description="only this goal's")] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
    ) -> m.ApprovalList:
        """Tool calls waiting for a decision across every running goal, oldest first."""
        c = client()
        pending = await c.pending_approvals(limit, goal_id)
        out = []
        for p in pending:
            with contextlib.suppress(NotFound):
                goal = await c.get(p.goal_id)
                title = None
                if goal.plan_version:
                    with contextlib.suppress(NotFound):
                        plan = await c.store.get_plan(p.goal_id)
                        title = next((t.title for t in plan.plan.tasks if t.id == p.task_id), None)
                out.append(
                    m.ApprovalOut(
                        goal_id=p.goal_id,
                        goal_text=goal.goal.text,
                        task_id=p.task_id,
                        task_title=title,
                        attempt=p.attempt,
                        call_id=p.call_id,
                        tool=p.tool,
                        arguments=p.arguments,
                        requested_at=datetime.fromtimestamp(p.requested_at, UTC),
                        earlier=p.earlier,
                    )
                )
        return m.ApprovalList(approvals=out)

    async def _decide(
        goal_id: str, call_id: str, approved: bool, body: m.DecisionIn | None, who: Principal
    ) -> m.Decided:
        reason = (body or m.DecisionIn()).reason
        if not approved and not reason:
            reason = f"denied by {who.name}"
        first = await client().decide(_goal_id(goal_id), call_id, approved, reason, by=who.name)
        if not first:
            raise ApiError(409, "conflict", f"tool call {goal_id}/{call_id} was already decided")
        log.info("api.decided", goal_id=goal_id, call_id=call_id, approved=approved, by=who.name)
        return m.Decided(goal_id=goal_id, call_id=call_id, approved=approved, by=who.name)

    decision_responses: dict[int | str, dict[str, Any]] = {
        404: {"model": m.ErrorBody},
        409: {"model": m.ErrorBody, "description": "already decided"},
        **body_errors,
    }

    @app.post(
        "/v1/approvals/{goal_id}/{call_id}/approve",
        response_model=m.Decided,
        tags=["approvals"],
        responses=decision_responses,
    )
    async def approve(
        goal_id: GoalIdPath,
        call_id: Annotated[str, Path(max_length=200)],
        who: Approver,
        _: JsonBody,
        body: m.DecisionIn | None = None,
    ) -> m.Decided:
        """Approve a tool call; its task resumes and runs it. Your token's name is recorded."""
        return await _decide(goal_id, call_id, True, body, who)

    @app.post(
        "/v1/approvals/{goal_id}/{call_id}/deny",
        response_model=m.Decided,
        tags=["approvals"],
        responses=decision_responses,
    )
    async def deny(
        goal_id: GoalIdPath,
        call_id: Annotated[str, Path(max_length=200)],
        who: Approver,
        _: JsonBody,
        body: m.DecisionIn | None = None,
    ) -> m.Decided:
        """Deny a tool call; the model is told, with the reason. Your token's name is recorded."""
        return await _decide(goal_id, call_id, False, body, who)

    @app.get("/v1/me", response_model=m.Me, tags=["auth"])
    async def me(who: Caller) -> m.Me:
        """The calling token's name and scopes (the console shows buttons by them)."""
        return m.Me(name=who.name, scopes=sorted(who.scopes & set(SCOPES)))

    # -- operations ---------------------------------------------------------------------------

    @app.get("/healthz", response_model=m.Health, tags=["operations"])
    async def healthz() -> m.Health:
        """The process is up (liveness)."""
        return m.Health(ok=True)

    @app.get("/readyz", response_model=m.Health, tags=["operations"], responses={503: {"model": m.Health}})
    async def readyz() -> Response:
        """Redis answers (readiness), and with TASKLOOM_API_READY_REQUIRES_WORKERS every role has a live
        worker: 503 otherwise."""
        reasons: list[str] = []
        try:
            await asyncio.wait_for(client().redis.ping(), 2)
            if config.ready_requires_workers:
                fleet = await asyncio.wait_for(_fleet(client()), 2)
                reasons = [f"no live {r.role} worker" for r in fleet.roles if not r.live_workers]
        except Exception as exc:  # a probe answers; it never raises
            reasons = [f"cannot reach Redis: {exc!r}"]
        if reasons:
            return JSONResponse(m.Health(ok=False, reasons=reasons).model_dump(), status_code=503)
        return JSONResponse(m.Health(ok=True).model_dump())

    @app.get("/v1/fleet", response_model=m.Fleet, tags=["operations"])
    async def fleet(_: Reader) -> m.Fleet:
        """Each role's live workers, queue depth and longest wait (what `taskloom health` reads);
        `ok` is false while any role has no live worker."""
        return await _fleet(client())

    @app.get(
        "/metrics",
        response_class=Response,
        tags=["operations"],
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics(_: Reader) -> Response:
        """Prometheus metrics of this process (the workers' registry, plus API request counts)."""
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    # -- the console --------------------------------------------------------------------------

    static = resources.files("taskloom.api") / "static"

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(str(static / "index.html"), headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    app.add_middleware(BodyLimit, limit=config.max_body, timeout=config.body_timeout)  # before anything reads a body
    app.add_middleware(RequestMetrics)
    return app


# Scripts only from this origin, nothing inline: text that slipped into markup still could not run.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _position(value: str | None, name: str) -> str | None:
    if value is None or value == "":
        return None
    if not STREAM_ID.match(value):
        raise ApiError(422, "invalid_request", f"{name}: expected a stream position such as 1700000000000-0", name)
    return value


async def _fleet(c: Client) -> m.Fleet:
    roles = [
        m.FleetRole(
            role=r.role,  # one of bus.keys.ROLES
            live_workers=r.live_workers,
            queue_depth=r.queue_depth,
            oldest_queued_age_s=r.oldest_queued_age_s,
        )
        for r in await health.load(c.redis, c.keys)
    ]
    node = None
    with contextlib.suppress(Exception):  # INFO may be refused (a managed Redis): the roles still answer
        n = await health.node_of(c.redis)
        node = m.FleetRedis(
            address=n.address,
            role=n.role,
            via_sentinel=n.via_sentinel,
            used_memory=n.used_memory,
            maxmemory=n.maxmemory,
            memory_full=n.memory_full,
        )
    writable = node is None or (node.role == "master" and not node.memory_full)
    ok = all(r.live_workers for r in roles) and writable
    return m.Fleet(ok=ok, roles=roles, redis=node, checked_at=datetime.now(UTC))


async def _summary(c: Client, goal_id: str) -> m.GoalSummary | None:
    try:
        goal = await c.get(goal_id)
    except NotFound:
        return None  # deleted between the index read and now
    tasks = await c.store.get_tasks(goal_id)
    current = [t for t in tasks.values() if t.state.value != "superseded"]  # dropped by a replan
    try:
        books = await c.ledger.snapshot(goal_id)
        spent, reserved = books.spent, books.reserved
    except LedgerNotFound:
        spent = reserved = 0
    return m.GoalSummary(
        id=goal.id,
        text=goal.goal.text,
        state=goal.state,
        plan_version=goal.plan_version,
        tasks_total=len(current),
        tasks_done=sum(1 for t in current if t.state.value == "done"),
        budget_tokens=goal.budget_tokens,
        spent_tokens=spent,
        reserved_tokens=reserved,
        created_at=goal.created_at,
        updated_at=goal.updated_at,
        reason=goal.reason,
    )


async def _attempts(c: Client, goal_id: str) -> m.AttemptsOut:
    goal = await c.get(goal_id)
    tasks = await c.store.get_tasks(goal_id)
    titles: dict[str, str] = {}
    if goal.plan_version:
        for v in range(1, goal.plan_version + 1):
            with contextlib.suppress(NotFound):
                titles.update({t.id: t.title for t in (await c.store.get_plan(goal_id, v)).plan.tasks})
    raw = await c.redis.hgetall(c.keys.results(goal_id))  # type: ignore[misc]
    results = [TaskResult.model_validate_json(v) for v in raw.values()]
    verdicts: dict[tuple[str, int], m.Verdict] = {}
    for e in await c.log.read(goal_id, count=100_000):
        if e.type == "critic.verdict" and e.task_id and "attempt" in e.data:
            verdicts[(e.task_id, int(e.data["attempt"]))] = m.Verdict(
                passed=bool(e.data.get("passed")),
                action=str(e.data.get("action", "")),
                feedback=str(e.data.get("feedback", "")),
            )
    out = []
    for tid, t in tasks.items():
        mine = sorted((r for r in results if r.task_id == tid), key=lambda r: r.attempt)
        out.append(
            m.TaskAttempts(
                task_id=tid,
                title=titles.get(tid, tid),
                state=t.state.value,
                attempt=t.attempt,
                feedback=t.feedback,
                attempts=[
                    m.AttemptOut(
                        attempt=r.attempt,
                        answer=r.answer,
                        stop_reason=r.stop_reason,
                        steps=r.steps,
                        tool_calls=r.tool_calls,
                        usage=r.usage,
                        created_at=r.created_at,
                        verdict=verdicts.get((tid, r.attempt)),
                    )
                    for r in mine
                ],
            )
        )
    return m.AttemptsOut(goal_id=goal_id, tasks=out)


END, KEEPALIVE, SHUTDOWN = "end", "keepalive", "shutdown"


async def _follow(c: Client, goal_id: str | None, after: str | None) -> AsyncGenerator[Event | str, None]:
    """Events after `after`, then `END` once the goal has ended (a goal's stream), with a
    `KEEPALIVE` now and then while nothing happens (so proxies and clients see a live stream)."""
    idle_since = time.monotonic()
    while True:
        batch = await c.log.read(goal_id, after=after or "0-0", count=200, block_ms=1000)
        for e in batch:
            after = e.position
            yield e
        if batch:
            idle_since = time.monotonic()
            continue
        if goal_id is not None and (await c.get(goal_id)).terminal:
            for e in await c.log.read(goal_id, after=after):  # written between the read and the check
                after = e.position
                yield e
            yield END
            return
        if time.monotonic() - idle_since > KEEPALIVE_S:
            idle_since = time.monotonic()
            yield KEEPALIVE


async def _until(
    draining: asyncio.Event, events: AsyncGenerator[Event | str, None]
) -> AsyncIterator[Event | str]:
    """The items of `events` until `draining` is set, then `SHUTDOWN` at once: a read waiting on
    Redis is cancelled, so that a stopping server is not held up by its open streams."""
    stop = asyncio.create_task(draining.wait())
    pending: asyncio.Task[Event | str | None] | None = None

    async def next_item() -> Event | str | None:
        return await anext(events, None)

    try:
        while True:
            pending = asyncio.create_task(next_item())
            await asyncio.wait({pending, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                yield SHUTDOWN
                return
            item = pending.result()
            if item is None:
                return
            yield item
    finally:
        for task in (stop, pending):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(RuntimeError):  # an async generator cancelled mid-read is already closed
            await events.aclose()


def _sse(events: AsyncGenerator[Event | str, None], draining: asyncio.Event) -> StreamingResponse:
    async def frames() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        async for e in _until(draining, events):
            if e == END:
                yield "event: end\ndata: {}\n\n"
                return
            if e == SHUTDOWN:
                yield f'retry: {SHUTDOWN_RETRY_MS}\nevent: shutdown\ndata: {{"reconnect": true}}\n\n'
                return
            if e == KEEPALIVE:
                yield ": keepalive\n\n"
                continue
            assert isinstance(e, Event)
            yield f"id: {e.position}\ndata: {e.model_dump_json()}\n\n"

    return StreamingResponse(
        frames(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
