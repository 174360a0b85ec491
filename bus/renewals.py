"""A worker process's lease renewals, batched: one pipelined call per interval for everything it holds.

While a job runs, three things must stay alive in Redis or another worker takes over: arq's
in-progress mark of the job (`taskloom.wake`), an executor attempt's lease (`bus.attempts`) and
the attempt's tenant running slot (`bus.tenants`). A timer of its own for each, per job, would mean
30 timers and 30 round trips per interval with 10 jobs running. Instead every hold of a process
joins one `Renewals`: a single ticker sends one non-transactional pipeline per interval with every
renewal in it (each renewal stays its own atomic command or script).

The guarantees are the timers': a held item is renewed within `period` of being held and then every
`period` (its TTL is at least 3 periods); an item whose worker died is no longer renewed and expires
with its TTL; an attempt lease that was taken over (its epoch moved on) is dropped at the first
renewal that finds it so, and reported by `AttemptLease.lost`. Leaving a hold waits for a renewal
in flight, so nothing is renewed after the caller has released it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError

from .attempts import AttemptStore, now_ms
from .tenants import Tenants

log = structlog.get_logger("taskloom.renewals")


class Renewal:
    """One thing to keep alive: `period` seconds between renewals (a third of its TTL)."""

    period: float = 1.0

    def add_to(self, pipe: Pipeline) -> Any:
        """Queue the renewal on `pipe`; return the Lua script it runs, if any (to load it when the
        server has lost its script cache, e.g. after a restart)."""
        raise NotImplementedError

    def settle(self, result: Any) -> bool:
        """Look at this renewal's reply; False drops the item (nothing left to renew)."""
        return True


class Expire(Renewal):
    """A key kept for `ttl` seconds (arq's in-progress mark of a running job)."""

    def __init__(self, key: str, ttl: float) -> None:
        self.key = key
        self.ttl_ms = int(ttl * 1000)
        self.period = ttl / 3

    def add_to(self, pipe: Pipeline) -> Any:
        pipe.pexpire(self.key, self.ttl_ms)
        return None

    async def renew(self, redis: Redis) -> None:
        """Renew it now, on its own."""
        await redis.pexpire(self.key, self.ttl_ms)


class AttemptLease(Renewal):
    """An executor attempt's lease, renewed under its epoch (a lease taken over stays lost)."""

    def __init__(self, store: AttemptStore, ttl: float) -> None:
        self.store = store
        self.ttl_ms = int(ttl * 1000)
        self.period = ttl / 3
        self.lost = False

    def add_to(self, pipe: Pipeline) -> Any:
        return self.store.renew_in(pipe, self.ttl_ms, now_ms())

    def settle(self, result: Any) -> bool:
        if not result:
            self.lost = True  # the next write of the attempt raises LeaseLost
            log.warning("lease.lost", member=self.store.member, epoch=self.store.epoch)
            return False
        return True


class TenantSlot(Renewal):
    """A tenant running slot (taken for `2 * ttl` seconds, renewed every `ttl / 3`)."""

    def __init__(self, tenants: Tenants, tenant: str, member: str, ttl: float) -> None:
        self.tenants = tenants
        self.tenant = tenant
        self.member = member
        self.ttl = 2 * ttl
        self.period = ttl / 3

    def add_to(self, pipe: Pipeline) -> Any:
        return self.tenants.acquire_slot_in(pipe, self.tenant, self.member, self.ttl)


class Renewals:
    """Every renewal of one process (share one per process; it runs its ticker only while it holds
    something)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._held: dict[int, Renewal] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._in_flight: asyncio.Future[None] | None = None
        self.rounds = 0  # pipelines sent (for tests and metrics)

    @contextlib.asynccontextmanager
    async def hold(self, *items: Renewal) -> AsyncIterator[None]:
        """Keep `items` alive while in the block."""
        for item in items:
            self._held[id(item)] = item
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="taskloom-renewals")
        try:
            yield
        finally:
            for item in items:
                self._held.pop(id(item), None)
            flight = self._in_flight
            if flight is not None and not flight.done():
                # A renewal already sent must land before the caller releases what it renews.
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(flight)

    async def _tick(self) -> None:
        while self._held:
            await asyncio.sleep(min(item.period for item in self._held.values()))
            if not self._held:
                return
            flight: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._in_flight = flight
            try:
                await self.renew_now()
            except Exception as exc:  # Redis away for a moment: the next round may still be in time
                log.warning("renewals.failed", error=repr(exc), held=len(self._held))
            finally:
                flight.set_result(None)

    async def renew_now(self) -> None:
        """Renew everything held, in one pipeline."""
        items = list(self._held.values())
        if not items:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            scripts = [item.add_to(pipe) for item in items]
            results = await pipe.execute(raise_on_error=False)
        self.rounds += 1
        for item, script, result in zip(items, scripts, results, strict=True):
            if isinstance(result, NoScriptError) and script is not None:
                await self.redis.script_load(script.script)  # renewed again next round, within its TTL
            elif isinstance(result, Exception):
                log.warning("renewal.failed", kind=type(item).__name__, error=repr(result))
            elif not item.settle(result):
                self._held.pop(id(item), None)
