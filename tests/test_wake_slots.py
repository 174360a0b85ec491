"""A worker whose slots are all taken starts a queued job as soon as one of its jobs ends, not at its
next poll timer (`WakeableWorker`'s job-end wake-up). Real Redis, real arq jobs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
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


def _worker(redis: ArqRedis, queue: str, work: Any, **kwargs: Any) -> WakeableWorker:
    return WakeableWorker(
        functions=[func(work, name="work")],
        redis_pool=redis,
        queue_name=queue,
        poll_delay=0.05,
        handle_signals=False,
        health_check_key=f"{queue}:health",
        keep_result=0,
        **kwargs,
    )


async def test_a_job_is_picked_up_in_one_round_trip_and_marked_for_the_lease(
    redis: ArqRedis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pick-up marks the job in progress for the worker's job lease (not arq's job timeout +
    10 s) and costs one script call, where arq's own sends WATCH, EXISTS, ZSCORE and MULTI/EXEC."""
    queue = f"{keys.prefix}claim"
    job_id = f"{keys.prefix}one"
    gate, seen = asyncio.Event(), asyncio.Event()

    async def work(ctx: dict[str, Any]) -> None:
        seen.set()
        await gate.wait()

    worker = _worker(redis, queue, work, job_lease=7.0)
    await redis.enqueue_job("work", _job_id=job_id, _queue_name=queue)
    sent: list[str] = []
    connection = await redis.connection_pool.get_connection()
    await redis.connection_pool.release(connection)
    cls, one, many = type(connection), type(connection).pack_command, type(connection).pack_commands
    monkeypatch.setattr(cls, "pack_command", lambda self, *args: sent.append(str(args[0]).upper()) or one(self, *args))
    monkeypatch.setattr(
        cls, "pack_commands", lambda self, cmds: sent.extend(str(c[0]).upper() for c in cmds) or many(self, cmds)
    )
    await worker.start_jobs([job_id.encode()])
    monkeypatch.undo()
    try:
        await asyncio.wait_for(seen.wait(), 5)
        ttl = await redis.pttl(f"arq:in-progress:{job_id}")
        assert 5_000 < ttl <= 7_000
        # EVALSHA, and after a NOSCRIPT (the first time on this server) SCRIPT LOAD and EVALSHA again.
        assert set(sent) <= {"EVALSHA", "SCRIPT LOAD"} and sent.count("EVALSHA") <= 2, sent
    finally:
        gate.set()
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        await redis.delete(f"arq:in-progress:{job_id}")


async def test_a_job_marked_in_progress_or_not_due_is_not_started(redis: ArqRedis, keys: Keys) -> None:
    """Another worker's mark, a job deferred into the future and a job gone from the queue are
    all left alone, and each leaves the worker's slot free."""
    queue = f"{keys.prefix}claim-skip"
    started: list[str] = []

    async def work(ctx: dict[str, Any], name: str) -> None:
        started.append(name)

    worker = _worker(redis, queue, work, max_jobs=1)
    marked, later = f"{keys.prefix}marked", f"{keys.prefix}later"
    await redis.enqueue_job("work", "marked", _job_id=marked, _queue_name=queue)
    await redis.enqueue_job("work", "later", _job_id=later, _queue_name=queue, _defer_by=60)
    await redis.set(f"arq:in-progress:{marked}", b"1", px=60_000)
    try:
        await worker.start_jobs([marked.encode(), later.encode(), f"{keys.prefix}gone".encode()])
        await asyncio.sleep(0.1)
        assert started == [] and worker.tasks == {}
        assert worker.job_counter == 0  # every slot free again
        assert await redis.pttl(f"arq:in-progress:{later}") == -2  # not marked
        # The mark gone, the same worker starts the job.
        await redis.delete(f"arq:in-progress:{marked}")
        await worker.start_jobs([marked.encode()])
        await asyncio.gather(*worker.tasks.values())
        assert started == ["marked"]
    finally:
        await redis.delete(f"arq:in-progress:{marked}", f"arq:job:{marked}", f"arq:job:{later}")
