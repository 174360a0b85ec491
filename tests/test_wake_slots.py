"""A worker whose slots are all taken starts a queued job as soon as one of its jobs ends, not at its
next poll timer (`WakeableWorker`'s job-end wake-up). Real Redis, real arq jobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from arq.connections import ArqRedis
from arq.worker import func
from helpers import eventually

from bus.keys import Keys
from taskloom.wake import WakeableWorker


async def test_a_full_worker_starts_the_queued_job_when_a_slot_frees(redis: ArqRedis, keys: Keys) -> None:
    queue = f"{keys.prefix}slots"
    started: dict[str, float] = {}
    ended: dict[str, float] = {}
    gate = asyncio.Event()

    async def work(ctx: dict[str, Any], name: str) -> None:
        started[name] = time.monotonic()
        if name == "first":
            await gate.wait()
        ended[name] = time.monotonic()

    worker = WakeableWorker(
        functions=[func(work, name="work")],
        redis_pool=redis,
        queue_name=queue,
        max_jobs=1,
        poll_delay=30,  # the fallback timer: far longer than this test waits
        handle_signals=False,
        health_check_key=f"{queue}:health",
        keep_result=0,
    )
    await redis.enqueue_job("work", "first", _job_id=f"{keys.prefix}first", _queue_name=queue)
    running = asyncio.create_task(worker.main())
    try:

        async def first_started() -> bool:
            return "first" in started

        await eventually(first_started, timeout=5)
        # Queued while the only slot is taken; no wake-up stream here: only a job end can start it.
        await redis.enqueue_job("work", "second", _job_id=f"{keys.prefix}second", _queue_name=queue)
        await asyncio.sleep(0.2)
        assert "second" not in started
        gate.set()

        async def second_started() -> bool:
            return "second" in started

        await eventually(second_started, timeout=5)
        assert started["second"] - ended["first"] < 1.0  # not the 30 s timer
    finally:
        gate.set()
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
