"""The HTTP API and web console: an ASGI app (FastAPI) over `bus.client.Client`.

It keeps no state of its own: every request reads or writes Redis through the client, so an API
process can be killed or scaled out at any time and nothing is lost. The routes are one router per
resource (`taskloom.api.routes`); what they share (the client, the caller's token and scopes) are
dependencies in `taskloom.api.deps`, and every error is answered by `taskloom.api.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from bus.client import Client
from bus.goal_index import GoalIndex

from . import models as m
from .deps import ApiConfig
from .errors import install_error_handlers
from .middleware import BodyLimit, RequestMetrics
from .routes import approvals, events, fleet, goals, live, tenants

__all__ = ["ApiConfig", "create_app", "drain"]

# Scripts only from this origin, nothing inline: text that slipped into markup still could not run.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def drain(app: FastAPI) -> None:
    """The server is stopping: every open event stream sends its `shutdown` frame and ends."""
    app.state.draining.set()


def create_app(
    client_factory: Callable[[], contextlib.AbstractAsyncContextManager[Client]], config: ApiConfig
) -> FastAPI:
    """The app. `client_factory` opens the Redis client for the app's lifetime."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with client_factory() as client:
            app.state.client = client
            app.state.index = GoalIndex(client.redis, client.keys)
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
    app.state.api_config = config
    app.state.draining = asyncio.Event()  # set by `drain`
    install_error_handlers(app)
    for resource in (goals, tenants, events, live, approvals, fleet):
        app.include_router(resource.router)

    static = resources.files("taskloom.api") / "static"

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        """The console."""
        return FileResponse(str(static / "index.html"), headers=_PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    app.add_middleware(BodyLimit, limit=config.max_body, timeout=config.body_timeout)  # before anything reads a body
    app.add_middleware(RequestMetrics)
    return app
