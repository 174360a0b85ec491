"""The ASGI wrappers around the API: request metrics, and the request body's size and time limits."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..metrics import REGISTRY
from .errors import error_response

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
        too_big = error_response(413, "payload_too_large", f"the request body is over the limit of {self.limit} bytes")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await error_response(400, "invalid_request", "Content-Length is not a number", "Content-Length")(
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
            await error_response(408, "request_timeout", late, headers={"Connection": "close"})(scope, receive, send)
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
