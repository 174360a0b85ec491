"""Which asyncio event loop a taskloom process runs on: `TASKLOOM_EVENT_LOOP`.

- `auto` (the default): uvloop when it is installed (it is a dependency of taskloom everywhere but
  on Windows, which it does not support), else asyncio's own loop. uvloop's loop and its socket
  transports are written in C (libuv): a worker's many small Redis and HTTP round trips each cost
  it less CPU in the loop's own turn and in its writes (bench/RESULTS.md, "uvloop").
- `uvloop`: uvloop, or a `EventLoopError` naming the package when it is not installed.
- `asyncio`: the standard library's loop, whatever is installed.

Nothing in taskloom depends on which loop runs: the code uses only asyncio's public API (uvloop
implements it), and the test suite runs both.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

T = TypeVar("T")

EVENT_LOOP_ENV = "TASKLOOM_EVENT_LOOP"
LoopName = Literal["uvloop", "asyncio"]


class EventLoopError(ValueError):
    """`TASKLOOM_EVENT_LOOP` names no loop, or names uvloop where it is not installed."""


def _uvloop_installed() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def choice(value: str | None = None) -> LoopName:
    """The loop to run: `value`, else `TASKLOOM_EVENT_LOOP`, else 'auto' (uvloop when importable)."""
    raw = value if value is not None else os.environ.get(EVENT_LOOP_ENV, "")
    wanted = raw.strip().lower() or "auto"
    if wanted == "asyncio":
        return "asyncio"
    if wanted == "uvloop":
        if not _uvloop_installed():
            raise EventLoopError(
                f"{EVENT_LOOP_ENV}=uvloop but uvloop is not installed: pip install uvloop (not on Windows), "
                f"or set {EVENT_LOOP_ENV}=asyncio"
            )
        return "uvloop"
    if wanted == "auto":
        return "uvloop" if _uvloop_installed() else "asyncio"
    raise EventLoopError(
        f"{EVENT_LOOP_ENV}={raw!r} is not an event loop: use 'auto' (the default), 'uvloop' or 'asyncio'"
    )


def loop_factory(name: LoopName) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What `asyncio.Runner` builds its loop with (None: asyncio's default)."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run(coro: Coroutine[Any, Any, T], loop: LoopName | None = None) -> T:
    """`asyncio.run(coro)` on the chosen loop (`loop`, else `choice()`)."""
    name = loop if loop is not None else choice()
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(coro)


def running() -> str:
    """The name of the running loop's implementation, for logs ('uvloop' or 'asyncio')."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
