"""The worker fleet as Redis sees it: heartbeats per role, queue depths, the wake-up streams.

Everything the composition root (`taskloom.health`, `taskloom.metrics`, `taskloom.wake`) reads or
writes about workers, so that no module outside `bus` talks to Redis. Keys from `bus.keys`:
* `workers(role)` sorted set: worker instance (`host:pid`) by heartbeat expiry (ms);
* `queue(role)` arq's queue, job id by the time (ms) it is due (ZCARD: waiting, deferred and
  running jobs: arq keeps a job there until it finishes); a running job also has arq's in-progress mark;
* `wake(role)` stream: one entry per enqueued job (`Jobs.enqueue`);
* arq's in-progress mark of a job (`arq:in-progress:<job id>`), set when a worker picks it up
  (`JobClaims`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from redis.asyncio import Redis

from .keys import ROLES, Keys, arq_in_progress
from .replies import as_str
from .scripts import Script, lua, registered

# Dead members are kept this long, so that `taskloom health` can say when a worker was last seen.
FORGET_AFTER_MS = 3600 * 1000


_CLAIM = lua("fleet_claim")


class JobClaims:
    """arq's pick-up of a job on one client, in one round trip instead of four (`bus/lua/fleet_claim.lua`)."""

    def __init__(self, redis: Redis) -> None:
        self._script: Script = registered(redis, _CLAIM)

    async def claim(self, queue: str, job_id: str, now: int, lease_ms: int) -> int | None:
        """Mark the queued job `job_id` in progress for `lease_ms` and return its score (ms), unless
        it is already in progress, no longer queued, or not due at `now` (ms): then None, and
        nothing is written."""
        score = await self._script(keys=[arq_in_progress(job_id), queue], args=[job_id, now, lease_ms])
        return None if score is None else int(float(as_str(score)))


def now_ms() -> int:
    return int(time.time() * 1000)


async def beat(redis: Redis, keys: Keys, roles: Sequence[str], instance: str, ttl: float) -> None:
    """Mark `instance` alive in each role for `ttl` seconds; forget members dead for an hour."""
    now = now_ms()
    async with redis.pipeline(transaction=False) as pipe:
        for role in roles:
            pipe.zadd(keys.workers(role), {instance: now + int(ttl * 1000)})
            pipe.zremrangebyscore(keys.workers(role), "-inf", now - FORGET_AFTER_MS)
        await pipe.execute()


async def deregister(redis: Redis, keys: Keys, roles: Sequence[str], instance: str) -> None:
    for role in roles:
        await redis.zrem(keys.workers(role), instance)


async def heartbeats(redis: Redis, keys: Keys, role: str) -> list[tuple[str, int]]:
    """The role's worker instances with their heartbeat expiry (ms)."""
    rows = await redis.zrange(keys.workers(role), 0, -1, withscores=True)
    return [(as_str(m), int(score)) for m, score in rows]


async def clear_health_checks(redis: Redis, keys: Keys, roles: Sequence[str]) -> None:
    """Delete arq's health-check keys of the roles (a stopped worker's would look alive for a while)."""
    await redis.delete(*(keys.health_check(r) for r in roles))


async def queue_depths(redis: Redis, keys: Keys, roles: Sequence[str] = ROLES) -> dict[str, int]:
    async with redis.pipeline(transaction=False) as pipe:
        for role in roles:
            pipe.zcard(keys.queue(role))
        counts = await pipe.execute()
    return {role: int(n) for role, n in zip(roles, counts, strict=True)}


async def oldest_waiting(redis: Redis, keys: Keys, role: str, now: int, page: int = 100) -> int | None:
    """When (ms) the role's longest-waiting job became due: the earliest due job no worker is running
    (a running job has arq's in-progress mark); None if no job waits. Deferred jobs are not due yet."""
    start = 0
    while True:
        rows = await redis.zrangebyscore(keys.queue(role), "-inf", now, start=start, num=page, withscores=True)
        if not rows:
            return None
        async with redis.pipeline(transaction=False) as pipe:
            for job_id, _ in rows:
                pipe.exists(arq_in_progress(as_str(job_id)))
            running = await pipe.execute()
        for (_, due), busy in zip(rows, running, strict=True):
            if not busy:
                return int(due)
        start += page


async def last_wake(redis: Redis, key: str) -> str:
    """Id of the wake stream's newest entry ('0-0' if none): a listener starts after it."""
    tail = await redis.xrevrange(key, count=1)
    return as_str(tail[0][0]) if tail else "0-0"


async def next_wake(redis: Redis, key: str, last: str, block_ms: int) -> str | None:
    """Block up to `block_ms` for entries after `last`; the newest entry's id, or None."""
    reply = await redis.xread({key: last}, count=100, block=block_ms)
    return as_str(reply[0][1][-1][0]) if reply else None
