"""arq's private parts that taskloom.wake relies on are still what they were in arq 0.28.

`taskloom.wake` re-implements `Worker.main` and `Worker.start_jobs`, calls `Worker._poll_iteration`,
renews arq's in-progress mark and filters `run_job`'s per-job log lines;
`bus.jobs.Jobs.enqueue` writes what `ArqRedis.enqueue_job` writes (job key, queue entry) in its own
script. An arq upgrade that changes any of them fails here, by name, instead of showing up as slow
recovery, a worker loop that silently drifts from arq's own, or jobs arq cannot read.
"""

from __future__ import annotations

import hashlib
import inspect
from fnmatch import fnmatchcase

import arq
import arq.jobs
from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix
from arq.jobs import Job, JobStatus
from arq.worker import Worker

from bus.keys import Keys, arq_in_progress, arq_job, arq_result
from taskloom.wake import ARQ_JOB_LINES

# sha256 (first 16 hex digits) of the source of the arq 0.28.0 methods taskloom.wake copies or calls.
# When arq changes one: read the new code, port the change into taskloom.wake, then update the digest.
KNOWN_SOURCES = {
    "main": "45ca1591c9717466",
    "_poll_iteration": "f8d39d823a0a59f2",
    "start_jobs": "b45797cfa40bed7f",
}


# ... and of the enqueue that bus.jobs re-implements as a script (with the serializer it calls).
KNOWN_ENQUEUE = {"enqueue_job": "7da8706a747c1171", "serialize_job": "1fc854cc50e16e5c"}


def _digest(name: str) -> str:
    return _hash(getattr(Worker, name))


def _hash(obj: object) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]  # type: ignore[arg-type]


def test_arq_is_the_version_taskloom_wake_was_written_against() -> None:
    """arq is 0.28.x (pyproject pins it; taskloom.wake names the version)."""
    assert arq.VERSION.startswith("0.28."), f"arq {arq.VERSION}: re-check taskloom/wake.py against it"


def test_the_worker_methods_taskloom_wake_copies_are_unchanged() -> None:
    """Worker.main, _poll_iteration and start_jobs have the source taskloom.wake was written against."""
    changed = {name: _digest(name) for name, known in KNOWN_SOURCES.items() if _digest(name) != known}
    assert changed == {}, f"arq changed these Worker methods; port them into taskloom/wake.py: {changed}"


def test_the_in_progress_mark_is_where_hold_job_renews_it() -> None:
    """start_jobs marks a job in progress at `arq:in-progress:<id>` for `in_progress_timeout_s`."""
    assert in_progress_key_prefix == "arq:in-progress:"
    source = inspect.getsource(Worker.start_jobs)
    assert "in_progress_key_prefix" in source and "self.in_progress_timeout_s" in source
    assert inspect.iscoroutinefunction(Worker._poll_iteration)


def test_the_slot_bookkeeping_wakes_start_jobs_shares_with_run_job_is_arqs() -> None:
    """`WakeableWorker.start_jobs` takes a slot as arq's does (`sem`, `job_counter`), starts
    `run_job(job_id, score)` in a task kept in `tasks`, and frees the slot with the same callback."""
    source = inspect.getsource(Worker.start_jobs)
    for part in (
        "self.sem.acquire()",
        "self.job_counter",
        "self.tasks[job_id] = t",
        "self.run_job(job_id, int(score))",
    ):
        assert part in source, f"arq's start_jobs no longer has {part!r}: re-check WakeableWorker.start_jobs"
    assert "self._release_sem_dec_counter_on_complete()" in source
    assert list(inspect.signature(Worker.run_job).parameters) == ["self", "job_id", "score"]
    release = inspect.getsource(Worker._release_sem_dec_counter_on_complete)
    assert "self.job_counter = self.job_counter - 1" in release and "self.sem.release()" in release


def test_the_enqueue_bus_jobs_writes_is_arqs() -> None:
    """`ArqRedis.enqueue_job` and `serialize_job` are unchanged: `Jobs.enqueue`'s script writes the
    same job key (`arq:job:<id>`, psetex with the job's expiry), the same queue entry (score = enqueue
    time) and checks the same result key (`arq:result:<id>`)."""
    found = {"enqueue_job": _hash(ArqRedis.enqueue_job), "serialize_job": _hash(arq.jobs.serialize_job)}
    assert found == KNOWN_ENQUEUE, f"arq changed its enqueue; port it into bus/jobs.py (_ENQUEUE): {found}"
    assert (job_key_prefix, result_key_prefix) == ("arq:job:", "arq:result:")
    assert inspect.signature(ArqRedis.__init__).parameters["expires_extra_ms"].default == 86_400_000


def test_the_per_job_log_lines_wake_filters_are_arqs() -> None:
    """run_job logs a job's start and end with the format strings `taskloom.wake.JobLinesFilter` drops."""
    source = inspect.getsource(Worker.run_job)
    for fmt in ARQ_JOB_LINES:
        assert repr(fmt) in source or f"'{fmt}'" in source, f"run_job no longer logs {fmt!r}"


async def _noop(ctx: dict[str, object]) -> None:
    return None


async def test_the_arq_keys_bus_names_are_the_keys_arq_writes_and_reads(redis: ArqRedis, keys: Keys) -> None:
    """`bus.keys` reads arq's key formats from `arq.constants`, in that one place. Checked against arq
    itself: its enqueue writes `arq_job`, its job status reads `arq_in_progress` and `arq_result`, its
    worker's health check is `Keys.health_check`, and `Keys.patterns` (the clean-up's SCAN) finds
    arq's keys of our jobs. A rename in arq fails here instead of leaving keys nobody reads."""
    queue = keys.queue("planner")
    job_id = keys.job_id("probe", 1)
    try:
        assert await redis.enqueue_job("probe", _job_id=job_id, _queue_name=queue) is not None
        assert await redis.exists(arq_job(job_id)) == 1
        job = Job(job_id, redis, _queue_name=queue)
        assert await job.status() is JobStatus.queued
        await redis.set(arq_in_progress(job_id), b"1", px=10_000)
        assert await job.status() is JobStatus.in_progress
        await redis.set(arq_result(job_id), b"r", px=10_000)
        assert await job.status() is JobStatus.complete
        worker = Worker([_noop], redis_pool=redis, queue_name=queue, handle_signals=False)
        assert worker.health_check_key == keys.health_check("planner")
        for key in (arq_job(job_id), arq_result(job_id), arq_in_progress(job_id)):
            assert any(fnmatchcase(key, pattern) for pattern in keys.patterns()), key
    finally:
        await redis.delete(queue, arq_job(job_id), arq_result(job_id), arq_in_progress(job_id))
