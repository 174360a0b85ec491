"""Job payloads and their queues: the one place that knows which role runs which job.

Every job carries one pydantic payload, validated again by the handler that receives it (a job
is input from Redis like any other). Job ids are deterministic, so enqueueing the same step twice
is a no-op in arq: it refuses a job id whose job or result key still exists.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix, job_key_prefix
from pydantic import BaseModel, ConfigDict, Field

from .keys import Keys
from .schemas import GoalId, TaskId
from .tracing import current_traceparent

WAKE_MAXLEN = 100  # wake-up streams only need their latest entries


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


class Jobs:
    def __init__(self, redis: ArqRedis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    def job_id(self, job: JobPayload) -> str:
        parts = job.id_parts()
        return self.keys.job_id(job.function, *parts, *([f"d{job.redrive}"] if job.redrive else []))

    async def enqueue(self, job: JobPayload) -> bool:
        """Enqueue `job` on its role's queue. False when that exact job was already enqueued."""
        if job.traceparent is None:
            traceparent = current_traceparent()
            if traceparent is not None:
                job = job.model_copy(update={"traceparent": traceparent})
        # Without a trace the payload has no `traceparent` key at all (as before tracing existed).
        payload = job.model_dump(mode="json", exclude={"traceparent"} if job.traceparent is None else None)
        queued = await self.redis.enqueue_job(
            job.function, payload, _job_id=self.job_id(job), _queue_name=self.keys.queue(job.role)
        )
        if queued is None:
            return False
        goal_id = getattr(job, "goal_id", None)
        if goal_id is not None:
            # The supervisor's view of who drives what: the last job enqueued for each slot.
            record = json.dumps({"job_id": self.job_id(job), "function": job.function, "payload": payload})
            await self.redis.hset(self.keys.drivers(goal_id), job.slot(), record)  # type: ignore[misc]
        # Wake the role's idle workers now (taskloom.wake); if this write is lost, their fallback
        # poll still finds the job, just later.
        await self.redis.xadd(self.keys.wake(job.role), {"job": self.job_id(job)}, maxlen=WAKE_MAXLEN, approximate=True)
        return True


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
            rows.append((slot.decode() if isinstance(slot, bytes) else str(slot), job_id, payload))
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, job_id, _ in rows:
                pipe.exists(job_key_prefix + job_id, in_progress_key_prefix + job_id)
            counts = await pipe.execute()
        return {slot: (job_id, payload, bool(n)) for (slot, job_id, payload), n in zip(rows, counts, strict=True)}


def parse_payload(function: str, raw: Any) -> JobPayload:
    """Validate a job's payload as read from Redis; raises pydantic's ValidationError naming the field."""
    return PAYLOADS[function].model_validate(raw)
