"""arq workers with wake-ups and short job leases.

Wake-ups: an idle worker reacts to a new job at once instead of at its next queue poll.

arq finds jobs by polling its queue (a sorted set) every `poll_delay`; the wait for the next poll
is nearly the whole cost of a hop between two roles (bench/hops.py: ~26 ms at 0.05 s, and 20 Redis
commands per second per idle worker). Here every enqueue also appends to a small Redis stream per
role (`Jobs.enqueue`), and each worker blocks on that stream: an entry makes it poll now. The poll
timer stays as the fallback (a lost wake-up costs at most one `poll_delay`), so it can be long.

The worker loop is arq 0.28's `Worker.main` (arq is pinned to 0.28.*) with the fixed-rate poll
replaced by "poll, then wait for a wake-up or the fallback timer". Burst mode is arq's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import redis.exceptions
import structlog
from arq.connections import log_redis_info
from arq.worker import Worker
from arq.worker import logger as arq_logger

log = structlog.get_logger("taskloom.wake")

BLOCK_MS = 1000  # one XREAD per second per idle worker while nothing happens


class WakeableWorker(Worker):
    def __init__(
        self, *args: Any, wake_key: str | None = None, job_lease: float | None = None, **kwargs: Any
    ) -> None:
        self.wake_key = wake_key
        self._woken = asyncio.Event()
        after = kwargs.pop("after_job_end", None)

        async def job_ended(ctx: dict[Any, Any]) -> None:
            # A slot is free again: look for queued work now, not at the next timer.
            self._woken.set()
            if after is not None:
                await after(ctx)

        super().__init__(*args, after_job_end=job_ended, **kwargs)
        if job_lease is not None:
            # arq marks a job it starts "in progress" for the longest job timeout + 10 s, and only
            # re-runs a dead worker's job once the mark expires. Marked for `job_lease` instead, and
            # renewed while the job runs (taskloom.workers._hold_job), a job whose worker died
            # between being picked up and starting is re-run within seconds, not minutes.
            self.in_progress_timeout_s = job_lease

    async def main(self) -> None:
        if self.burst or self.wake_key is None:
            await super().main()
            return
        arq_logger.info("Starting worker for %d functions: %s", len(self.functions), ", ".join(self.functions))
        # INFO only feeds a start-up log line; a server that refuses it (an ACL without INFO, or
        # fakeredis under `taskloom.testing`) must not stop the worker.
        with contextlib.suppress(redis.exceptions.ResponseError):
            await log_redis_info(self.pool, arq_logger.info)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        listener = asyncio.create_task(self._listen(self.wake_key))
        try:
            while True:
                self._woken.clear()  # before polling: a wake-up arriving during the poll is kept
                await self._poll_iteration()
                # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that arrives
                # as the event is set, and the worker would then never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_delay_s):
                        await self._woken.wait()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen(self, key: str) -> None:
        """Set the wake-up event for every new entry of the role's wake stream."""
        last = "0-0"
        with contextlib.suppress(redis.exceptions.RedisError):
            tail = await self.pool.xrevrange(key, count=1)
            if tail:
                last = tail[0][0].decode() if isinstance(tail[0][0], bytes) else str(tail[0][0])
        while True:
            try:
                reply = await self.pool.xread({key: last}, count=100, block=BLOCK_MS)
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("wake.listen_failed", error=str(exc))  # the poll timer still works
                await asyncio.sleep(1)
                continue
            if reply:
                entry = reply[0][1][-1][0]
                last = entry.decode() if isinstance(entry, bytes) else str(entry)
                self._woken.set()
