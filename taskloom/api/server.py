"""`taskloom api`: serve the API and console with uvicorn on one socket, registered in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from bus.client import Client
from bus.connection import connect
from bus.consoles import deregister, register_forever

from ..metrics import refresh_queue_depth_forever
from ..settings import Settings
from ..workers import keys_for
from . import models as m
from .app import ApiConfig, create_app, drain

# Seconds a stop waits for requests in flight; event streams end at once (see `ApiServer.shutdown`).
GRACEFUL_S = 5


class JsonErrorsH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, except that a request it cannot parse (`Content-Length: abc`, a
    malformed request or header line) is answered in the API's JSON error shape, not in
    plain text. It is called while uvicorn handles h11's error, whose message names the problem."""

    def send_400_response(self, msg: str) -> None:
        exc = sys.exc_info()[1]
        problem = str(exc) if isinstance(exc, h11.RemoteProtocolError) and str(exc) else msg
        field = "Content-Length" if "content-length" in problem.lower() else None
        detail = m.ErrorDetail(type="invalid_request", message=f"malformed HTTP request: {problem}", field=field)
        body = m.ErrorBody(error=detail).model_dump_json().encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body)):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        self.transport.close()


class ApiServer(uvicorn.Server):
    """uvicorn, set up as `taskloom api` runs it. Its stop first ends every open event stream with a
    `shutdown` frame (uvicorn would otherwise wait for them, then cancel them with an error), and
    uvicorn's re-raise of SIGTERM/SIGINT after a graceful stop (the process would die of the signal)
    is left out: `serve` handles them, so that a clean stop exits 0 like `taskloom worker` does."""

    def __init__(self, app: FastAPI) -> None:
        super().__init__(
            uvicorn.Config(
                app,
                http=JsonErrorsH11,
                log_config=None,
                access_log=False,
                lifespan="on",
                timeout_graceful_shutdown=GRACEFUL_S,
            )
        )
        self.app = app

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain(self.app)
        await super().shutdown(sockets)


class ApiStartError(Exception):
    """The API cannot start as asked; the message names the option or variable."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ApiStartError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def public_url(settings: Settings, host: str, port: int) -> str:
    if settings.api_public_url:
        return settings.api_public_url.rstrip("/") + "/"
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/"


async def serve(settings: Settings, sock: socket.socket, config: ApiConfig, url: str) -> None:
    """Run until SIGINT/SIGTERM. Every piece of state is in Redis: stopping loses nothing."""
    from .. import tracing

    tracing.configure(settings)  # a submit's `goal` span is exported from here (TASKLOOM_TRACING=otlp)
    async with connect(settings.redis_url, settings.home, share=settings.redis_shared_connection) as redis:
        keys = keys_for(settings)
        client = Client(redis, keys, settings.default_budget_tokens, settings.events_maxlen)

        @contextlib.asynccontextmanager
        async def shared() -> AsyncIterator[Client]:
            yield client

        server = ApiServer(create_app(shared, config))
        background = [
            asyncio.create_task(register_forever(redis, keys, url, settings.heartbeat_ttl)),
            asyncio.create_task(refresh_queue_depth_forever(redis, keys, settings.metrics_interval)),
        ]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        try:
            await server.serve(sockets=[sock])
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(Exception):
                await deregister(redis, keys, url)
            tracing.flush()
