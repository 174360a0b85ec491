"""What both fake provider servers share: a stdlib HTTP server on loopback in a daemon thread, and the
script queue, fallback responder and request log their handlers draw on.

A subclass sets `handler` (its `BaseHTTPRequestHandler`, which reaches the server as `self.fake`) and
`thread_name`, and builds its `base_url` on `root_url`.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypeVar

from llm.types import Usage


class _Server(ThreadingHTTPServer):
    # The stdlib's listen backlog is 5: a fleet opening hundreds of connections at once (a wide
    # fan-out, one connection per call in flight) overflowed it, and the kernel dropped their SYNs
    # for the client to retry 1 s, 3 s, 7 s later. A provider's endpoint has a deep backlog.
    request_queue_size = 1024
    # TCP connections accepted so far: whether clients reuse their kept-alive connections or open
    # new ones (`LoopbackServer.connections`). Counted on the one thread that accepts them.
    accepted = 0

    def process_request(self, request: Any, client_address: Any) -> None:
        self.accepted += 1
        super().process_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-request (a worker stopped with calls in flight) is not the
        # fake's error: the stdlib would print a traceback for each such connection.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


ScriptT = TypeVar("ScriptT")
RecordT = TypeVar("RecordT")


class LoopbackServer(Generic[ScriptT, RecordT]):
    """A scripted fake: answers with enqueued items in order, then with `respond_with`'s function.
    Use as a (sync or async) context manager, or start()/close()."""

    handler: ClassVar[type[BaseHTTPRequestHandler]]
    thread_name: ClassVar[str] = "fake-server"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._queue: deque[ScriptT] = deque()
        self._responder: Callable[[RecordT], ScriptT] | None = None
        self._requests: list[RecordT] = []
        self._billed = Usage()
        self._ids = itertools.count(1)
        self._closing = threading.Event()
        # Seconds after which the server closes a kept-alive connection that sent nothing more, as a
        # provider's endpoint or its load balancer does; None: kept until the client closes it. Set
        # before start().
        self.idle_timeout: float | None = None
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._httpd is not None:
            return self
        bound = type("_BoundHandler", (self.handler,), {"fake": self, "timeout": self.idle_timeout})
        httpd = _Server((self._host, self._port), bound)
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._closing.set()  # wakes handlers sleeping on a `delay`
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def connections(self) -> int:
        """TCP connections the server has accepted since it started (a kept-alive one counts once)."""
        return self._httpd.accepted if self._httpd is not None else 0

    @property
    def root_url(self) -> str:
        """`http://host:port` of the running server."""
        if self._httpd is None:
            raise RuntimeError("the fake server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- scripting ------------------------------------------------------------------------------

    def enqueue(self, *items: ScriptT) -> Self:
        """Answer the next requests with `items`, in order (before any `respond_with` function)."""
        with self._lock:
            self._queue.extend(items)
        return self

    def respond_with(self, responder: Callable[[RecordT], ScriptT] | None) -> Self:
        """Answer every request the queue does not cover with `responder(request)` (None: stop)."""
        with self._lock:
            self._responder = responder
        return self

    @property
    def pending(self) -> int:
        """Enqueued items not used yet."""
        with self._lock:
            return len(self._queue)

    @property
    def requests(self) -> list[RecordT]:
        """Every request received so far."""
        with self._lock:
            return list(self._requests)

    @property
    def billed(self) -> Usage:
        """The usage of every successful reply served (including ones the client stopped waiting for)."""
        with self._lock:
            return self._billed

    def _scripted(self, request: RecordT) -> ScriptT | None:
        """The next enqueued item, else the responder's answer; None when nothing is scripted."""
        with self._lock:
            if self._queue:
                return self._queue.popleft()
            responder = self._responder
        return None if responder is None else responder(request)
