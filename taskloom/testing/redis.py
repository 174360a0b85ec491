"""The Redis a test run uses: fakeredis in this process (with Lua), or a real server by URL.

fakeredis runs our Lua scripts with Lua 5.1 (the `lupa` package; Redis embeds 5.1 too) and arq's
queue commands, blocking `XREAD` included. The one command it lacks that our code sends is `INFO`,
which only feeds a start-up log line and is skipped when refused (`taskloom.wake`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from arq.connections import create_pool

from bus.connection import RedisPool, redis_settings
from bus.keys import Keys
from bus.retention import delete_all

INSTALL_HINT = "pip install 'taskloom[testing]'"


class TestingSetupError(RuntimeError):
    """A package the testing kit needs is missing; the message says which and how to install it."""


def new_fake_server() -> Any:
    """A fresh, empty fakeredis server (one per run unless you share one)."""
    if importlib.util.find_spec("fakeredis") is None:
        raise TestingSetupError(f"taskloom.testing runs goals on fakeredis, which is not installed: {INSTALL_HINT}")
    if importlib.util.find_spec("lupa") is None:
        raise TestingSetupError(
            f"fakeredis needs the lupa package to run taskloom's Lua scripts (fakeredis[lua]): {INSTALL_HINT}"
        )
    import fakeredis

    return fakeredis.FakeServer()


def fake_redis(server: Any = None) -> RedisPool:
    """An arq Redis client on a fakeredis server (a new empty one unless `server` is given)."""
    import fakeredis

    server = server if server is not None else new_fake_server()
    # arq's client on fakeredis' connection pool: the same client class production uses.
    return RedisPool(connection_pool=fakeredis.FakeAsyncRedis(server=server).connection_pool)


def unique_prefix() -> str:
    return f"tltest:{uuid.uuid4().hex[:12]}:"


@dataclass
class TestRedis:
    """Where a test's runs keep their state: a fakeredis server, or a real server (`url`), always
    under a key prefix of its own.

    `await taskloom_redis.hgetall(key)` (any Redis command) runs one command on a connection of its
    own, in whatever event loop awaits it; `async with taskloom_redis.connect() as redis:` gives an
    arq client for anything more (pipelines, scans, a `taskloom.Client`).
    """

    __test__ = False  # not a test class, whatever pytest thinks of the name

    url: str | None = None
    prefix: str = field(default_factory=unique_prefix)
    server: Any = None

    def __post_init__(self) -> None:
        if self.url is None and self.server is None:
            self.server = new_fake_server()

    @property
    def keys(self) -> Keys:
        return Keys(prefix=self.prefix)

    @property
    def fake(self) -> bool:
        return self.url is None

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[RedisPool]:
        redis = fake_redis(self.server) if self.url is None else await create_pool(redis_settings(self.url))
        try:
            yield redis
        finally:
            await redis.aclose(close_connection_pool=True)

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name.startswith("_") or not callable(getattr(RedisPool, name, None)):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        async def command(*args: Any, **kwargs: Any) -> Any:
            async with self.connect() as redis:
                return await getattr(redis, name)(*args, **kwargs)

        return command

    async def clear(self) -> int:
        """Delete every key of this prefix, arq's job and result keys included (on a real server
        shared with others: never FLUSHDB). Returns how many were deleted."""
        async with self.connect() as redis:
            return await delete_all(redis, Keys(prefix=self.prefix))
