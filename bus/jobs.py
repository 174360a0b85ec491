"""Job payloads and their queues: the one place that knows which role runs which job.

Every job carries one pydantic payload, validated again by the handler that receives it (a job
is input from Redis like any other). Job ids are deterministic, so enqueueing the same step twice
is a no-op in arq: it refuses a job id whose job or result key still exists.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from arq.connections import ArqRedis
from arq.jobs import serialize_job
from arq.utils import timestamp_ms
from pydantic import BaseModel, ConfigDict, Field

from .batch import ScriptCall, run_scripts
from .keys import Keys, arq_in_progress, arq_job, arq_result
from .replies import as_str
from .schemas import GoalId, TaskId
from .scripts import lua, registered
from .tracing import current_traceparent

WAKE_MAXLEN = 100  # wake-up streams only need their latest entries
# arq 0.28's default lifetime of a queued job's key (`ArqRedis.expires_extra_ms`): a day.
JOB_EXPIRES_MS = 86_400_000

_ENQUEUE = lua("jobs_enqueue")

# Roles whose wake-up is owed by the current `Jobs.batch()` (None outside one).
_BATCH: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("taskloom_wake_batch", default=None)


class JobPayload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: ClassVar[str]
    function: ClassVar[str]
    # 0 normally; the supervisor re-drives a stranded goal or task with a new number, so that the
    # job gets a fresh id (arq refuses an id whose failed or finished result it still keeps).
    redrive: int = Field(default=0, ge=0)
    # The W3C traceparent of the step that enqueued the job (bus.tracing): the job's span continues
    # that trace on whichever worker runs it. Not part of the job id. Absent when tracing is off.
    traceparent: str | None = Field(default=None, max_length=128)

    def id_parts(self) -> tuple[str | int, ...]:
        raise NotImplementedError

    def slot(self) -> str:
        """What this job drives: `goal`, or `task:<id>` (the supervisor's bookkeeping)."""
        return "goal"


class PlanJob(JobPayload):
    role = "planner"
    function = "plan"
    goal_id: GoalId

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id,)


class AdvanceJob(JobPayload):
    """After a task was accepted: dispatch what became ready. One per accepted attempt."""

    role = "planner"
    function = "advance"
    goal_id: GoalId
    task_id: TaskId
    attempt: int = Field(ge=1)

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id, self.task_id, self.attempt)


class ReplanJob(JobPayload):
    role = "planner"
    function = "replan"
    goal_id: GoalId
    plan_version: int = Field(ge=1, description="the version being replaced (makes the job id unique)")
    reason: str = ""

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id, self.plan_version)


class ExecuteJob(JobPayload):
    role = "executor"
    function = "execute"
    goal_id: GoalId
    task_id: TaskId
    attempt: int = Field(ge=1)
    # 0 for the first run of an attempt; a resume (dead executor, approval given) carries a new
    # number so that it gets its own job id. Every copy resumes from the attempt's stored steps.
    resume: int = Field(default=0, ge=0)

    def id_parts(self) -> tuple[str | int, ...]:
        base: tuple[str | int, ...] = (self.goal_id, self.task_id, self.attempt)
        return base if not self.resume else (*base, f"r{self.resume}")

    def slot(self) -> str:
        return f"task:{self.task_id}"


class ReviewJob(JobPayload):
    role = "critic"
    function = "review"
    goal_id: GoalId
    task_id: TaskId
    attempt: int = Field(ge=1)

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id, self.task_id, self.attempt)

    def slot(self) -> str:
        return f"task:{self.task_id}"


class ReviewGoalJob(JobPayload):
    """Write the final answer (and its verdict) from one set of task attempts (`bus.synthesis`)."""

    role = "critic"
    function = "review_goal"
    goal_id: GoalId
    plan_version: int = Field(ge=1)
    # The attempts key the answer is written from; "" (a job from an older planner): the tasks'
    # current attempts, once all are accepted.
    attempts: str = Field(default="", pattern=r"^[0-9a-f]{0,64}$")

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id, self.plan_version, *([self.attempts] if self.attempts else []))


PAYLOADS: dict[str, type[JobPayload]] = {
    cls.function: cls for cls in (PlanJob, AdvanceJob, ReplanJob, ExecuteJob, ReviewJob, ReviewGoalJob)
}


async def finished_job_ids(redis: ArqRedis, keys: Keys, goal_id: str) -> list[str]:
    """Ids of the goal's jobs that arq keeps a result of (it keeps them for an hour by default)."""
    found = []
    async for raw in redis.scan_iter(match=arq_result(keys.job_id("*")), count=1000):
        job_id = as_str(raw).removeprefix(arq_result(""))
        if f":{goal_id}" in job_id:
            found.append(job_id)
    return found


class Jobs:
    def __init__(self, redis: ArqRedis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._enqueue = registered(redis, _ENQUEUE)
        self._serializer = getattr(redis, "job_serializer", None)  # arq's pickle unless the pool says otherwise
        self._expires_ms = int(getattr(redis, "expires_extra_ms", JOB_EXPIRES_MS))

    def job_id(self, job: JobPayload) -> str:
        parts = job.id_parts()
        return self.keys.job_id(job.function, *parts, *([f"d{job.redrive}"] if job.redrive else []))

    async def enqueue(self, job: JobPayload) -> bool:
        """Enqueue `job` on its role's queue. False when that exact job was already enqueued.

        Inside `batch()`, the role's workers are woken once when the batch ends, not per job."""
        batch = _BATCH.get()
        call = self._enqueue_call(job, wake=batch is None)
        queued = await call.script(keys=call.keys, args=call.args)
        if not queued:
            return False
        if batch is not None:
            batch.add(job.role)
        return True

    async def enqueue_with(
        self,
        job: JobPayload,
        *others: ScriptCall,
        before: ScriptCall | None = None,
        extra: Sequence[Sequence[Any]] = (),
    ) -> tuple[bool, Any]:
        """`enqueue(job)`, with independent script calls (each atomic on its own) in the same round
        trip: `before` ahead of the enqueue, `others` after it, then the plain commands `extra`.
        Returns whether the job was enqueued and `before`'s reply, or the exception it raised, for
        the caller to judge (None without one); an error of the enqueue, of `others` or of `extra`
        is raised once all have run."""
        batch = _BATCH.get()
        ahead = [] if before is None else [before]
        calls = [*ahead, self._enqueue_call(job, wake=batch is None), *others]
        replies = await run_scripts(self.redis, calls, extra=extra)
        first = replies.pop(0) if ahead else None
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        if replies[0] and batch is not None:
            batch.add(job.role)
        return bool(replies[0]), first

    async def enqueue_many(self, jobs: Sequence[JobPayload]) -> list[bool]:
        """Enqueue independent jobs in one round trip (each its own atomic script, as `enqueue`),
        with one wake-up per role after the last of them; for each, whether it was enqueued.

        The wake-up goes out even when every job was already enqueued (then it costs an idle
        worker one poll). Inside `batch()`, the batch's end wakes instead."""
        if len(jobs) <= 1:
            return [await self.enqueue(job) for job in jobs]  # the wake-up rides in the script
        batch = _BATCH.get()
        roles = sorted({job.role for job in jobs})
        wakes = [] if batch is not None else [self._wake_command(role) for role in roles]
        replies = await run_scripts(self.redis, [self._enqueue_call(job, wake=False) for job in jobs], extra=wakes)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        if batch is not None:
            batch.update(roles)
        return [bool(reply) for reply in replies]

    def _wake_command(self, role: str) -> tuple[str | int, ...]:
        return ("XADD", self.keys.wake(role), "MAXLEN", "~", WAKE_MAXLEN, "*", "job", "batch")

    def _enqueue_call(self, job: JobPayload, *, wake: bool) -> ScriptCall:
        """The enqueue script's call for `job`; `wake`: it also wakes the role's idle workers."""
        if job.traceparent is None:
            traceparent = current_traceparent()
            if traceparent is not None:
                job = job.model_copy(update={"traceparent": traceparent})
        # Without a trace the payload has no `traceparent` key at all (as before tracing existed).
        payload = job.model_dump(mode="json", exclude={"traceparent"} if job.traceparent is None else None)
        job_id = self.job_id(job)
        goal_id = getattr(job, "goal_id", None)
        # The supervisor's view of who drives what: the last job enqueued for each slot.
        driver = (
            json.dumps({"job_id": job_id, "function": job.function, "payload": payload}) if goal_id is not None else ""
        )
        now = timestamp_ms()
        serialized = serialize_job(job.function, (payload,), {}, None, now, serializer=self._serializer)
        return ScriptCall(
            self._enqueue,
            [
                arq_job(job_id),
                arq_result(job_id),
                self.keys.queue(job.role),
                self.keys.drivers(goal_id) if goal_id is not None else self.keys.queue(job.role),
                self.keys.wake(job.role),
            ],
            # Wake the role's idle workers now (taskloom.wake); if this is lost, their fallback poll
            # still finds the job, just later.
            [
                job_id,
                serialized,
                self._expires_ms,
                now,
                job.slot() if driver else "",
                driver,
                "1" if wake else "0",
                WAKE_MAXLEN,
            ],
        )

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        """Enqueues inside wake each role's workers once, at the end (one XADD per role instead of one
        per job). A wake-up lost to a crash in between costs a fallback poll, as any lost wake-up."""
        if _BATCH.get() is not None:  # nested: the outer batch wakes
            yield
            return
        roles: set[str] = set()
        token = _BATCH.set(roles)
        try:
            yield
        finally:
            _BATCH.reset(token)
            if roles:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for role in sorted(roles):
                        pipe.execute_command(*self._wake_command(role))
                    await pipe.execute()

    async def drivers(self, goal_id: str) -> dict[str, tuple[str, JobPayload | None, bool]]:
        """The last job enqueued for each of the goal's slots: (job id, payload, still queued or running).

        arq keeps a job's key from enqueue until it finishes, through deferred retries (`Retry`) and
        through a re-run after its worker died; a finished or failed job has none.
        """
        raw = await self.redis.hgetall(self.keys.drivers(goal_id))  # type: ignore[misc]
        rows: list[tuple[str, str, JobPayload | None]] = []
        for slot, value in raw.items():
            try:
                record = json.loads(value)
                payload: JobPayload | None = parse_payload(record["function"], record["payload"])
                job_id = str(record["job_id"])
            except (ValueError, KeyError, TypeError):
                payload, job_id = None, ""  # a damaged record drives nothing
            rows.append((as_str(slot), job_id, payload))
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, job_id, _ in rows:
                pipe.exists(arq_job(job_id), arq_in_progress(job_id))
            counts = await pipe.execute()
        return {slot: (job_id, payload, bool(n)) for (slot, job_id, payload), n in zip(rows, counts, strict=True)}


def parse_payload(function: str, raw: Any) -> JobPayload:
    """Validate a job's payload as read from Redis; raises pydantic's ValidationError naming the field."""
    return PAYLOADS[function].model_validate(raw)
