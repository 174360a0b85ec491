"""Every shape the HTTP API sends or accepts (the OpenAPI document is generated from these)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from bus.approvals import EarlierCall
from bus.schemas import Goal, GoalRecord, GoalState, StoredPlan, TaskRecord
from bus.stops import TaskStop
from llm.types import Usage

Scope = Literal["read", "submit", "approve", "admin"]


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class _In(BaseModel):
    # Strict at the HTTP boundary: JSON `true` is not a number and `"5000"` is not an integer.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_NUMBER = re.compile(r"^\s*[+-]?\d+(\.\d*)?\s*$")


def _date_time_text(v: object) -> object:
    # Lax pydantic reads a number, or a string of digits, as Unix time: JSON callers must write ISO 8601.
    if v is not None and (not isinstance(v, str) or _NUMBER.match(v)):
        raise ValueError("expected an ISO 8601 date-time string with a time zone, such as 2026-10-13T12:00:00Z")
    return v


class GoalIn(Goal):
    """A goal as `POST /v1/goals` takes it: every field of `bus.schemas.Goal` (new ones too), strictly
    typed: no boolean or numeric string for a number, no number for a string."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    # Strict mode reads a date-time only from a Python datetime, never from JSON text: this one field
    # is lax, and takes ISO 8601 text only.
    deadline: Annotated[datetime | None, BeforeValidator(_date_time_text)] = Field(
        default=None, strict=False, description=Goal.model_fields["deadline"].description
    )

    def to_goal(self) -> Goal:
        return Goal.model_validate(dict(self))


class ErrorDetail(_Out):
    type: str = Field(
        description="invalid_request, unauthorized, forbidden, not_found, conflict, payload_too_large, ..."
    )
    message: str = Field(description="what is wrong, in a sentence")
    field: str | None = Field(default=None, description="the input field at fault (dotted path), if any")


class ErrorBody(_Out):
    error: ErrorDetail


class Submitted(_Out):
    goal_id: str
    created: bool = Field(description="false when an earlier request with the same Idempotency-Key stored it")


class GoalSummary(_Out):
    """One row of the goals table."""

    id: str
    text: str
    state: GoalState
    plan_version: int
    tasks_total: int
    tasks_done: int
    budget_tokens: int
    spent_tokens: int
    reserved_tokens: int
    created_at: datetime
    updated_at: datetime
    reason: str | None


class GoalList(_Out):
    goals: list[GoalSummary]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null: no more goals")


class GoalStatusOut(_Out):
    goal: GoalRecord
    plan: StoredPlan | None
    tasks: list[TaskRecord]


class PlanTask(_Out):
    id: str
    title: str
    state: str
    depends_on: list[str]
    tools: list[str]
    definition_of_done: str


class PlanEdge(_Out):
    model_config = ConfigDict(frozen=True, populate_by_name=True)

    source: str = Field(alias="from")
    to: str


class PlanOut(_Out):
    """The DAG of one plan version with each task's state, as JSON and as a Mermaid flowchart."""

    goal_id: str
    version: int
    reason: str
    tasks: list[PlanTask]
    edges: list[PlanEdge]
    order: list[str] | None
    cycle: list[str] | None
    ready: list[str]
    mermaid: str


class Verdict(_Out):
    passed: bool
    action: str
    feedback: str


class AttemptOut(_Out):
    attempt: int
    answer: str
    stop_reason: TaskStop
    steps: int
    tool_calls: int
    usage: Usage
    created_at: datetime
    verdict: Verdict | None = Field(description="the critic's verdict on this attempt, once given")


class TaskAttempts(_Out):
    task_id: str
    title: str
    state: str
    attempt: int
    feedback: str | None
    attempts: list[AttemptOut]


class AttemptsOut(_Out):
    goal_id: str
    tasks: list[TaskAttempts]


class CancelIn(_In):
    reason: str = Field(default="cancelled through the API", min_length=1, max_length=1000)


class Cancelled(_Out):
    goal_id: str
    changed: bool = Field(
        description="always true: this request cancelled the goal (an ended goal, cancelled included, is a 409)"
    )


class ApprovalOut(_Out):
    """A tool call waiting for a person, and who asked: the goal and task whose agent wants to call it."""

    goal_id: str
    goal_text: str
    task_id: str
    task_title: str | None
    attempt: int
    call_id: str
    tool: str
    arguments: dict[str, Any]
    requested_at: datetime
    earlier: list[EarlierCall] = Field(
        default_factory=list,
        description="the task's earlier calls of this tool, every attempt so far, and how each ended",
    )


class ApprovalList(_Out):
    approvals: list[ApprovalOut]


class DecisionIn(_In):
    reason: str = Field(
        default="", max_length=2000, description="recorded in the audit event; a denial shows it to the model"
    )


class Decided(_Out):
    goal_id: str
    call_id: str
    approved: bool
    by: str = Field(description="the name of the token that decided (recorded in the audit event)")


class Me(_Out):
    name: str
    scopes: list[Scope]


class Health(_Out):
    ok: bool
    reasons: list[str] = Field(default_factory=list)


class FleetRole(_Out):
    role: Literal["planner", "executor", "critic"]
    live_workers: int = Field(description="worker processes of the role with a fresh heartbeat")
    queue_depth: int = Field(description="jobs in the role's queue: waiting, deferred (a retry's backoff) or running")
    oldest_queued_age_s: float | None = Field(
        description="seconds the longest-waiting due job has waited for a worker; null: no job waits"
    )


class FleetRedis(_Out):
    address: str = Field(description="host:port (the master the Sentinels name, with a Sentinel URL) or socket")
    role: str = Field(description="the node's replication role: master, or slave (a replica: nothing can be written)")
    via_sentinel: bool
    used_memory: int = Field(description="bytes")
    maxmemory: int = Field(description="bytes; 0: no limit")
    memory_full: bool = Field(description="past maxmemory: every write is refused (OOM) and goals wait")


class Fleet(_Out):
    """The workers as Redis sees them (what `taskloom health` reads)."""

    ok: bool = Field(description="false when any role has no live worker, or Redis cannot take writes")
    roles: list[FleetRole]
    redis: FleetRedis | None = Field(default=None, description="the Redis node the fleet writes to; null: unread")
    checked_at: datetime = Field(description="when this was read (UTC)")
