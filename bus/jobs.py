"""Job payloads and their queues: the one place that knows which role runs which job.

Every job carries one pydantic payload, validated again by the handler that receives it (a job
is input from Redis like any other). Job ids are deterministic, so enqueueing the same step twice
is a no-op in arq: it refuses a job id whose job or result key still exists.
"""

from __future__ import annotations

from typing import Any, ClassVar

from arq.connections import ArqRedis
from pydantic import BaseModel, ConfigDict, Field

from .keys import Keys
from .schemas import GoalId, TaskId

WAKE_MAXLEN = 100  # wake-up streams only need their latest entries


class JobPayload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: ClassVar[str]
    function: ClassVar[str]

    def id_parts(self) -> tuple[str | int, ...]:
        raise NotImplementedError


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


class ReviewJob(JobPayload):
    role = "critic"
    function = "review"
    goal_id: GoalId
    task_id: TaskId
    attempt: int = Field(ge=1)

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id, self.task_id, self.attempt)


class ReviewGoalJob(JobPayload):
    role = "critic"
    function = "review_goal"
    goal_id: GoalId
    plan_version: int = Field(ge=1)

    def id_parts(self) -> tuple[str | int, ...]:
        return (self.goal_id, self.plan_version)


PAYLOADS: dict[str, type[JobPayload]] = {
    cls.function: cls for cls in (PlanJob, AdvanceJob, ReplanJob, ExecuteJob, ReviewJob, ReviewGoalJob)
}


def functions_of(role: str) -> list[str]:
    return [name for name, cls in PAYLOADS.items() if cls.role == role]


class Jobs:
    def __init__(self, redis: ArqRedis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    def job_id(self, job: JobPayload) -> str:
        return self.keys.job_id(job.function, *job.id_parts())

    async def enqueue(self, job: JobPayload) -> bool:
        """Enqueue `job` on its role's queue. False when that exact job was already enqueued."""
        queued = await self.redis.enqueue_job(
            job.function,
            job.model_dump(mode="json"),
            _job_id=self.job_id(job),
            _queue_name=self.keys.queue(job.role),
        )
        if queued is None:
            return False
        # Wake the role's idle workers now (taskloom.wake); if this write is lost, their fallback
        # poll still finds the job, just later.
        await self.redis.xadd(self.keys.wake(job.role), {"job": self.job_id(job)}, maxlen=WAKE_MAXLEN, approximate=True)
        return True


def parse_payload(function: str, raw: Any) -> JobPayload:
    """Validate a job's payload as read from Redis; raises pydantic's ValidationError naming the field."""
    return PAYLOADS[function].model_validate(raw)
