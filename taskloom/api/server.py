"""`taskloom api`: serve the API and console with uvicorn on one socket, registered in Redis."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import socket
from collections.abc import AsyncIterator, Iterator

import uvicorn

from bus.client import Client
from bus.connection import connect
from bus.consoles import deregister, register_forever

from ..metrics import refresh_queue_depth_forever
from ..settings import Settings
from ..workers import keys_for
from .app import ApiConfig, create_app


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after a graceful stop (the process then dies of the signal);
    we handle them ourselves, so that a clean stop exits 0 like `taskloom worker` does."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


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
    async with connect(settings.redis_url, settings.home) as redis:
        keys = keys_for(settings)
        client = Client(redis, keys, settings.default_budget_tokens, settings.events_maxlen)

        @contextlib.asynccontextmanager
        async def shared() -> AsyncIterator[Client]:
            yield client

        app = create_app(shared, config)
        server = _Server(
            uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5)
        )
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
