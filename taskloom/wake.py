"""arq workers with wake-ups and short job leases: every use of arq's internals, in one module.

Written against arq 0.28 (pinned to 0.28.* in pyproject.toml). It relies on private things of
arq, each checked by tests/test_arq_internals.py, which fails loudly when an arq upgrade changes
them: `Worker.main` (re-implemented below), `Worker._poll_iteration` (called below),
`Worker.start_jobs` (re-implemented below, with the slot bookkeeping it shares with `run_job`:
`sem`, `job_counter`, `tasks`, `_release_sem_dec_counter_on_complete`), the in-progress mark
`arq:in-progress:<job id>` with `Worker.in_progress_timeout_s` (`hold_job`, `bus.fleet.JobClaims`), and the
format of `run_job`'s per-job log lines (`JobLinesFilter`).

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
import logging
from typing import Any

import structlog
from arq.connections import log_redis_info
from arq.utils import timestamp_ms
from arq.worker import Worker
from arq.worker import logger as arq_logger

from bus import fleet
from bus.connection import RedisError
from bus.keys import arq_in_progress
from bus.renewals import Expire, Renewals

log = structlog.get_logger("taskloom.wake")

BLOCK_MS = 1000  # one XREAD per second per idle worker while nothing happens

# arq 0.28 `Worker.run_job` logs "<t>s → <job>(<args>)" when a job starts and "<t>s ← <job> ● ..."
# when it ends, with these format strings.
ARQ_JOB_LINES = ("%6.2fs → %s(%s)%s", "%6.2fs ← %s ● %s")


class JobLinesFilter(logging.Filter):
    """Drops arq's own line per job start and end: the job wrapper logs `job.start` and `job.end`
    with the goal, task and attempt, so arq's lines only doubled the logging cost of a job (each
    line is a JSON record through the same processors). arq's retry, failure and abort lines stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in ARQ_JOB_LINES


_JOB_LINES_FILTER = JobLinesFilter()


def reconnect_delay(failures: int) -> float:
    """Seconds to wait after `failures` Redis errors in a row: 0.1 s doubling up to 5 s."""
    return float(min(5.0, 0.1 * 2 ** min(failures - 1, 10)))


class WakeableWorker(Worker):
    def __init__(self, *args: Any, wake_key: str | None = None, job_lease: float | None = None, **kwargs: Any) -> None:
        self.wake_key = wake_key
        self._woken = asyncio.Event()
        after = kwargs.pop("after_job_end", None)

        async def job_ended(ctx: dict[Any, Any]) -> None:
            # A slot is free again: when every slot was taken (this job still counts here), a poll
            # found work it could not start, so look for queued work now, not at the next timer.
            # With a slot to spare, every wake-up was already followed by a poll that started what
            # was queued: another poll would only ask Redis again (one per job, in a busy fleet).
            # Likewise when the last poll read a full page of the queue (there may be more behind it).
            if self.job_counter >= self.max_jobs or self._page_full:
                # Once the slot is free: arq frees it in a done callback of the job's task, added
                # before this one, so it runs first. Set now, the poll could run before it, still
                # find every slot taken, and leave the job queued until the timer.
                task = self.tasks.get(str(ctx.get("job_id")))
                if task is None:
                    self._woken.set()
                else:
                    task.add_done_callback(lambda _: self._woken.set())
            if after is not None:
                await after(ctx)

        super().__init__(*args, after_job_end=job_ended, **kwargs)
        self._page_full = False  # the last poll read `queue_read_limit` ids: more may be queued
        self._claims: fleet.JobClaims | None = None  # on the pool, at the first poll (arq may make the pool then)
        if _JOB_LINES_FILTER not in arq_logger.filters:
            arq_logger.addFilter(_JOB_LINES_FILTER)
        if job_lease is not None:
            # arq marks a job it starts "in progress" for the longest job timeout + 10 s, and only
            # re-runs a dead worker's job once the mark expires. Marked for `job_lease` instead, and
            # renewed while the job runs (taskloom.wake.hold_job), a job whose worker died
            # between being picked up and starting is re-run within seconds, not minutes.
            self.in_progress_timeout_s = job_lease

    async def main(self) -> None:
        if self.burst:
            await super().main()
            return
        arq_logger.info("Starting worker for %d functions: %s", len(self.functions), ", ".join(self.functions))
        # INFO only feeds a start-up log line; a server that refuses it (an ACL without INFO, or
        # fakeredis under `taskloom.testing`) or is briefly unreachable must not stop the worker.
        with contextlib.suppress(RedisError, OSError):
            await log_redis_info(self.pool, arq_logger.info)
        self.ctx["redis"] = self.pool
        if self.on_startup:
            await self.on_startup(self.ctx)
        listener = asyncio.create_task(self._listen(self.wake_key)) if self.wake_key else None
        failures = 0
        try:
            while True:
                self._woken.clear()  # before polling: a wake-up arriving during the poll is kept
                try:
                    await self._poll_iteration()
                    if failures:
                        log.warning("worker.poll_recovered", failures=failures)
                    failures = 0
                    wait = self.poll_delay_s
                except Exception as exc:
                    # arq's own loop ends the worker on the first Redis error (a restart, a
                    # failover, memory full: OOM refuses arq's in-progress key). Keep running
                    # instead: redis-py reconnects on the next command, and the wait grows so that
                    # a long outage costs a few commands a second, not a core. Logged as a warning
                    # once per episode (its first failure, and its end), the repeats as info.
                    failures += 1
                    wait = reconnect_delay(failures)
                    (log.warning if failures == 1 else log.info)(
                        "worker.poll_failed", error=repr(exc), retry_in=round(wait, 3), failures=failures
                    )
                # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that arrives
                # as the event is set, and the worker would then never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._woken.wait()
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """arq's `start_jobs`, with the pick-up of each job in one round trip, and without the jobs
        this worker is running itself.

        arq 0.28 picks a job up with WATCH, EXISTS, ZSCORE, then MULTI, PSETEX, EXEC: four round
        trips and six commands for every job, the most of any step of a taskloom job (client CPU on
        a busy worker is mostly per round trip). `bus.fleet.JobClaims` makes the same decision with the
        same keys atomically in a script: mark the job in progress for `in_progress_timeout_s` unless it
        is already marked, has left the queue, or is not due yet (its score, in ms, later than now
        by this worker's clock, as arq compares it). Then the job runs exactly as arq starts it
        (`run_job`, in a task in `self.tasks`, its slot freed when it ends).

        A poll returns every due job still in the queue, and a job stays there until it finishes, so
        a poll also returns the jobs this worker runs: those are skipped without asking Redis. One
        that ended (a deferred retry, due again) is not. Also notes whether the poll read a full page
        (`_page_full`, see `job_ended`).
        """
        self._page_full = len(job_ids) >= self.queue_read_limit
        running = {job_id for job_id, task in self.tasks.items() if not task.done()}
        if self._claims is None:
            self._claims = fleet.JobClaims(self.pool)
        for job_id_b in job_ids:
            job_id = job_id_b.decode()
            if job_id in running:
                continue
            await self.sem.acquire()
            if self.job_counter >= self.max_jobs:
                self.sem.release()
                return
            self.job_counter += 1
            try:
                score = await self._claims.claim(
                    self.queue_name, job_id, timestamp_ms(), int(self.in_progress_timeout_s * 1000)
                )
            except BaseException:
                self._release_sem_dec_counter_on_complete()  # the slot is not taken (arq's own leaks it)
                raise
            if score is None:
                # Running elsewhere, finished and gone from the queue, or deferred by another worker.
                self._release_sem_dec_counter_on_complete()
                arq_logger.debug("job %s already running elsewhere", job_id)
                continue
            task = asyncio.get_running_loop().create_task(self.run_job(job_id, score))
            task.add_done_callback(lambda _: self._release_sem_dec_counter_on_complete())
            self.tasks[job_id] = task

    async def _listen(self, key: str) -> None:
        """Set the wake-up event for every new entry of the role's wake stream."""
        last = "0-0"
        with contextlib.suppress(RedisError):
            last = await fleet.last_wake(self.pool, key)
        failures = 0
        while True:
            try:
                newest = await fleet.next_wake(self.pool, key, last, BLOCK_MS)
                failures = 0
            except (RedisError, OSError) as exc:
                failures += 1
                log.warning("wake.listen_failed", error=str(exc))  # the poll timer still works
                await asyncio.sleep(reconnect_delay(failures))
                continue
            if newest is not None:
                last = newest
                self._woken.set()


async def hold_job(ctx: dict[str, Any], ttl: float, renewals: Renewals | None = None) -> None:
    """Keep arq's "in progress" mark of a running job alive in short leases.

    arq marks a started job in progress for the longest job timeout + 10 s (over 10 minutes here),
    and only re-runs the job of a dead worker once that mark expires. Our workers set the mark for
    `ttl` when they pick a job up (`WakeableWorker`), and this renews it while the job runs, so
    another worker re-runs a dead worker's job after at most `ttl` seconds; every handler is safe
    to run twice. (In arq 0.28 the mark is `arq:in-progress:<job id>`; if it changes, jobs still
    run, just without this shortcut, and tests/test_arq_internals.py fails.)
    """
    mark = Expire(arq_in_progress(str(ctx.get("job_id"))), ttl)
    if renewals is not None:
        # With the process's other renewals: one pipeline per interval for all its jobs (bus.renewals).
        async with renewals.hold(mark):
            await asyncio.Event().wait()
    redis = ctx["redis"]
    while True:
        # The worker set the mark for `ttl` when it picked the job up, a moment ago: the first
        # renewal is due a third of the way through (most jobs end before it, and send none).
        await asyncio.sleep(ttl / 3)
        with contextlib.suppress(Exception):  # a missed renewal only risks an early duplicate run
            await mark.renew(redis)
