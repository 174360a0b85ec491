"""Where the web console runs: each API process (`taskloom api`) registers its URL in Redis with a
heartbeat, so that `taskloom run` and `taskloom demo` can print the console's address of a goal.

One sorted set (`Keys.api_endpoints`), member = the console URL, score = the time (ms) until which
the registration counts; refreshed every third of `ttl`, removed on a clean stop. A killed API
process simply stops refreshing and drops out after `ttl`.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from redis.asyncio import Redis

from .keys import Keys
from .replies import as_str

log = structlog.get_logger("taskloom.consoles")


def _now_ms() -> int:
    return int(time.time() * 1000)


async def register(redis: Redis, keys: Keys, url: str, ttl: float) -> None:
    now = _now_ms()
    async with redis.pipeline(transaction=True) as pipe:
        pipe.zadd(keys.api_endpoints(), {url: now + int(ttl * 1000)})
        pipe.zremrangebyscore(keys.api_endpoints(), "-inf", now - 3600_000)
        await pipe.execute()


async def register_forever(redis: Redis, keys: Keys, url: str, ttl: float) -> None:
    while True:
        try:
            await register(redis, keys, url, ttl)
        except Exception as exc:
            log.warning("api.register_failed", error=repr(exc))
        await asyncio.sleep(ttl / 3)


async def deregister(redis: Redis, keys: Keys, url: str) -> None:
    await redis.zrem(keys.api_endpoints(), url)


async def console_url(redis: Redis, keys: Keys) -> str | None:
    """The URL of a live API process's console (the most recently refreshed), or None."""
    rows = await redis.zrevrangebyscore(keys.api_endpoints(), "+inf", _now_ms(), start=0, num=1)
    if not rows:
        return None
    url = rows[0]
    return as_str(url)
