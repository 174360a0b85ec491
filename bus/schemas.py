"""The records that cross a process boundary: goals, plans, tasks, results, verdicts, events.

`Plan` is also the input schema of the model-facing tool `submit_plan`, and `Verdict` the form of the
critic's JSON reply (see "The model protocol" in docs/internals.md): their field names are a
contract with the model, so they stay as they are. Every record read back from Redis is validated
again (`model_validate_json`): a corrupt record is an error naming the field, never a silently wrong
value.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

# Token usage is the model port's own type: one definition for the wire, the ledger and results.
from llm.types import ModelResponse, Usage

from .stops import TaskStop
from .tracing import current_trace_id

# Task ids appear in Redis keys, job ids and tool-call idempotency keys: keep them plain.
TASK_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
GOAL_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
# The largest token budget of one goal (and of TASKLOOM_DEFAULT_BUDGET_TOKENS).
MAX_BUDGET_TOKENS = 100_000_000

# A goal's task hashes live at `<tasks key>:<task id>` beside its task-id set `<tasks key>:ids`, so a
# task named `ids` would overwrite the set and silently vanish from the DAG.
RESERVED_TASK_IDS = frozenset({"ids"})


def _not_reserved(task_id: str) -> str:
    if task_id in RESERVED_TASK_IDS:
        raise ValueError(f"task id {task_id!r} is reserved; choose another id")
    return task_id


NonEmpty = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
TaskId = Annotated[str, StringConstraints(pattern=TASK_ID_PATTERN), AfterValidator(_not_reserved)]
GoalId = Annotated[str, StringConstraints(pattern=GOAL_ID_PATTERN)]

def utcnow() -> datetime:
    return datetime.now(UTC)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# How much model review a goal gets (docs/internals.md, "Review policies"): every task and the
# final answer (the default); only the final answer; or none (machine checks and the critic's
# deterministic checks still apply).
ReviewPolicy = Literal["every_task", "final_only", "none"]


class Check(_Model):
    """A machine-checkable definition of done: when a task carries one, the critic decides from it
    alone, without a model call. Every condition given must hold."""

    tools_called: list[str] = Field(default_factory=list, description="tools it must call")
    pattern: str | None = Field(default=None, max_length=1_000, description="regex the answer matches")
    json_schema: dict[str, Any] | None = Field(default=None, description="JSON Schema the answer meets")

    @field_validator("pattern")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"pattern is not a valid regular expression: {exc}") from None
        return v

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            import jsonschema

            try:
                jsonschema.validators.validator_for(v).check_schema(v)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"json_schema is not a valid JSON Schema: {exc.message}") from None
        return v

    @model_validator(mode="after")
    def _something(self) -> Check:
        if not self.tools_called and self.pattern is None and self.json_schema is None:
            raise ValueError("a check needs at least one of tools_called, pattern, json_schema")
        return self


# -- goals ------------------------------------------------------------------------------------


class Goal(_Model):
    """What an application asks for."""

    text: NonEmpty = Field(max_length=20_000, description="the goal, in natural language")
    definition_of_done: str = Field(default="", max_length=5_000, description="how to tell it is done")
    budget_tokens: int | None = Field(
        default=None, gt=0, le=MAX_BUDGET_TOKENS, description="token budget; unset = the configured default"
    )
    budget_usd: float | None = Field(
        default=None, gt=0, le=1_000_000, description="dollar budget (cache-aware prices); unset = none"
    )
    tenant: str = Field(
        default="default", pattern=r"^[A-Za-z0-9_.@-]{1,64}$", description="whose pool the goal spends from"
    )
    allowed_tools: list[str] | None = Field(default=None, description="tool names allowed; unset = all loaded")
    metadata: dict[str, str] = Field(default_factory=dict, description="free-form labels, returned as given")
    deadline: datetime | None = Field(default=None, description="absolute time after which the goal fails")
    review: ReviewPolicy = Field(
        default="every_task", description="model review: every_task (default), final_only or none"
    )
    check: Check | None = Field(
        default=None, description="a machine-checkable definition of done for the final answer"
    )
    model: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}$",
        description="a model alias of the workers' models file, used by every role of this goal; unset = "
        "each role's configured model",
    )

    @field_validator("deadline")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        if v is not None and v.tzinfo is None:
            raise ValueError("deadline must carry a time zone (e.g. 2026-10-13T12:00:00Z)")
        return v

    @field_validator("allowed_tools")
    @classmethod
    def _tools(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not t.strip() for t in v):
            raise ValueError("tool names must not be empty")
        return v


class GoalState(StrEnum):
    SUBMITTED = "submitted"
    PLANNING = "planning"
    RUNNING = "running"
    REPLANNING = "replanning"
    REVIEWING = "reviewing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    BUDGET_EXHAUSTED = "budget_exhausted"


class GoalRecord(_Model):
    """A goal as stored: what was asked, where it stands, and how it ended."""

    id: GoalId
    goal: Goal
    state: GoalState = GoalState.SUBMITTED
    budget_tokens: int = Field(gt=0)
    plan_version: int = Field(default=0, ge=0)
    replans: int = Field(default=0, ge=0)
    resumes: int = Field(default=0, ge=0, description="times `resume` restarted it after it failed")
    answer: str | None = None
    reason: str | None = Field(default=None, description="why it failed, was cancelled or ran out")
    # The W3C traceparent of the goal's root span (bus.tracing); None when tracing was off at submit.
    traceparent: str | None = Field(default=None, max_length=128)
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)

    @property
    def terminal(self) -> bool:
        return self.state in GOAL_TERMINAL


# -- plans ------------------------------------------------------------------------------------


class TaskSpec(_Model):
    """One node of the plan's DAG (an input field of the `submit_plan` tool)."""

    id: TaskId = Field(description="short unique id, letters, digits, _ or -")
    title: NonEmpty = Field(max_length=200)
    instructions: NonEmpty = Field(max_length=10_000, description="what the executor must do")
    depends_on: list[TaskId] = Field(default_factory=list, description="ids of tasks that must finish first")
    definition_of_done: NonEmpty = Field(max_length=2_000, description="how the critic checks the result")
    tools: list[str] = Field(default_factory=list, description="names of the tools the task may use")
    check: Check | None = Field(default=None, description="machine check of the answer, instead of a review")


class Plan(_Model):
    """The input schema of `submit_plan`: a DAG of tasks."""

    tasks: list[TaskSpec] = Field(min_length=1, max_length=200)
    rationale: str = Field(default="", max_length=5_000, description="why this decomposition")

    def task(self, task_id: str) -> TaskSpec | None:
        """The spec of one task of this plan (None when the plan has no such task)."""
        return next((t for t in self.tasks if t.id == task_id), None)

    def task_ids(self) -> list[str]:
        return [t.id for t in self.tasks]


# How the planner's first call went (docs/internals.md, "Route first"): the model submitted a plan,
# or called the goal's tools itself (the goal is one task whose first step that call was), or
# answered in text (one task whose answer that text is).
PlanRoute = Literal["plan", "tool", "text"]


class StoredPlan(_Model):
    goal_id: GoalId
    version: int = Field(ge=1)
    plan: Plan
    reason: str = Field(default="", description="why this version was made (first plan, replan because ...)")
    route: PlanRoute = "plan"
    # For a routed plan: the planner's model turn, the first step of attempt 1 of its one task. Stored
    # with the plan in one write, so a re-run planner never asks again and the executor continues it.
    first_turn: ModelResponse | None = None
    created_at: datetime = Field(default_factory=utcnow)


# -- tasks ------------------------------------------------------------------------------------


class TaskState(StrEnum):
    PENDING = "pending"
    READY = "ready"
    RUNNING = "running"
    WAITING_APPROVAL = "waiting_approval"
    REVIEWING = "reviewing"
    RETRYING = "retrying"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"


class TaskRecord(_Model):
    """A task's place in its state machine; one per (goal, task id)."""

    goal_id: GoalId
    task_id: TaskId
    state: TaskState = TaskState.PENDING
    attempt: int = Field(default=0, ge=0, description="0 until first dispatched, then 1, 2, ...")
    # Attempt numbers keep counting across plan versions (they are part of job ids); retries are
    # counted from the first attempt of the current plan version.
    first_attempt: int = Field(default=1, ge=1, description="first attempt under the current plan version")
    plan_version: int = Field(default=1, ge=1)
    reason: str | None = None
    feedback: str | None = Field(default=None, description="the critic's feedback for the next attempt")
    updated_at: datetime = Field(default_factory=utcnow)


class TaskProgress(NamedTuple):
    """Where a task stands, without the rest of its record: what the critic's checks of a whole plan
    read (`Store.get_progress`: every result in review, every task accepted)."""

    state: TaskState
    attempt: int


class TaskResult(_Model):
    """What one attempt of a task produced."""

    goal_id: GoalId
    task_id: TaskId
    attempt: int = Field(ge=1)
    answer: str = ""
    stop_reason: TaskStop  # why the attempt stopped (bus.stops)
    steps: int = Field(default=0, ge=0)
    tool_calls: int = Field(default=0, ge=0)
    usage: Usage = Field(default_factory=Usage)
    created_at: datetime = Field(default_factory=utcnow)


class Verdict(_Model):
    """The critic's judgement of one result: the object of its JSON reply (`critic.prompts.VERDICT_FORMAT`)."""

    passed: bool = Field(description="meets the definition of done (action accept)")
    feedback: str = Field(default="", max_length=5_000, description="what is missing or wrong")
    action: Literal["accept", "retry", "replan"]

    @model_validator(mode="after")
    def _consistent(self) -> Verdict:
        if self.passed != (self.action == "accept"):
            raise ValueError("passed=true goes with action 'accept', and passed=false with 'retry' or 'replan'")
        if not self.passed and not self.feedback.strip():
            raise ValueError("feedback is required when the result does not pass")
        return self


class FinalVerdict(_Model):
    """The input schema of `submit_final`: the goal's final answer and the critic's verdict on it,
    written in one call (synthesis and goal review together)."""

    answer: str = Field(max_length=50_000)
    passed: bool = Field(description="meets the definition of done (action accept)")
    feedback: str = Field(default="", max_length=5_000, description="what is missing")
    action: Literal["accept", "replan"]

    @model_validator(mode="after")
    def _consistent(self) -> FinalVerdict:
        if self.passed != (self.action == "accept"):
            raise ValueError("passed=true goes with action 'accept', and passed=false with 'replan'")
        if not self.passed and not self.feedback.strip():
            raise ValueError("feedback is required when the answer does not pass")
        if self.passed and not self.answer.strip():
            raise ValueError("answer is required when it passes")
        return self


# -- events -----------------------------------------------------------------------------------

EVENT_TYPE_PATTERN = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")


class Event(_Model):
    """One thing that happened to a goal, as read from its stream."""

    type: str = Field(pattern=EVENT_TYPE_PATTERN.pattern, description="e.g. goal.submitted, task.state")
    goal_id: GoalId
    task_id: TaskId | None = None
    at: datetime = Field(default_factory=utcnow)
    data: dict[str, Any] = Field(default_factory=dict)
    position: str | None = Field(default=None, description="stream id; pass it back to resume after it")
    # The trace of the step that emitted it (bus.tracing), so an event leads to its spans.
    trace_id: str | None = Field(default_factory=current_trace_id, description="OpenTelemetry trace id (hex)")


# -- state machines ---------------------------------------------------------------------------

GOAL_TERMINAL = frozenset({GoalState.SUCCEEDED, GoalState.FAILED, GoalState.CANCELLED, GoalState.BUDGET_EXHAUSTED})
_GOAL_STOPS = {GoalState.FAILED, GoalState.CANCELLED, GoalState.BUDGET_EXHAUSTED}

GOAL_TRANSITIONS: dict[GoalState, frozenset[GoalState]] = {
    GoalState.SUBMITTED: frozenset({GoalState.PLANNING, *_GOAL_STOPS}),
    GoalState.PLANNING: frozenset({GoalState.RUNNING, *_GOAL_STOPS}),
    GoalState.RUNNING: frozenset({GoalState.REPLANNING, GoalState.REVIEWING, *_GOAL_STOPS}),
    GoalState.REPLANNING: frozenset({GoalState.RUNNING, *_GOAL_STOPS}),
    GoalState.REVIEWING: frozenset({GoalState.SUCCEEDED, GoalState.REPLANNING, *_GOAL_STOPS}),
    GoalState.SUCCEEDED: frozenset(),
    GoalState.FAILED: frozenset(),
    GoalState.CANCELLED: frozenset(),
    GoalState.BUDGET_EXHAUSTED: frozenset(),
}

TASK_TERMINAL = frozenset({TaskState.DONE, TaskState.FAILED, TaskState.CANCELLED, TaskState.SUPERSEDED})
_TASK_STOPS = {TaskState.FAILED, TaskState.CANCELLED, TaskState.SUPERSEDED}

TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.PENDING: frozenset({TaskState.READY, *_TASK_STOPS}),
    TaskState.READY: frozenset({TaskState.RUNNING, *_TASK_STOPS}),
    TaskState.RUNNING: frozenset({TaskState.REVIEWING, TaskState.WAITING_APPROVAL, *_TASK_STOPS}),
    TaskState.WAITING_APPROVAL: frozenset({TaskState.RUNNING, *_TASK_STOPS}),
    TaskState.REVIEWING: frozenset({TaskState.DONE, TaskState.RETRYING, *_TASK_STOPS}),
    TaskState.RETRYING: frozenset({TaskState.RUNNING, *_TASK_STOPS}),
    # A replan may drop an accepted or failed task; a later plan may bring a dropped id back.
    TaskState.DONE: frozenset({TaskState.SUPERSEDED}),
    TaskState.FAILED: frozenset({TaskState.SUPERSEDED}),
    TaskState.CANCELLED: frozenset(),
    TaskState.SUPERSEDED: frozenset({TaskState.PENDING}),
}


# `resume` (Client.resume) is the one way out of `failed` and `budget_exhausted`, in its own script:
# to `planning` (no plan yet) or `running`. It is not in GOAL_TRANSITIONS, so that no late job of the
# ended run can move such a goal. Its tasks in these states go back to `pending`; `done` ones stay.
GOAL_RESUMABLE = frozenset({GoalState.FAILED, GoalState.BUDGET_EXHAUSTED})
RESUME_RESETS = frozenset(
    {
        TaskState.READY,
        TaskState.RUNNING,
        TaskState.WAITING_APPROVAL,
        TaskState.REVIEWING,
        TaskState.RETRYING,
        TaskState.FAILED,
    }
)


def goal_sources(target: GoalState) -> frozenset[GoalState]:
    """Every goal state from which `target` may be reached."""
    return frozenset(s for s, nxt in GOAL_TRANSITIONS.items() if target in nxt)


def task_sources(target: TaskState) -> frozenset[TaskState]:
    """Every task state from which `target` may be reached."""
    return frozenset(s for s, nxt in TASK_TRANSITIONS.items() if target in nxt)


# Size limits stay out of the schema the model reads: every tool definition is paid per call, the
# limits are generous, and they are still enforced when the input is validated (an input over one is
# sent back naming the field, so the model learns a limit on the rare call that meets it).
_SIZE_LIMITS = frozenset({"maxLength", "minLength", "maxItems", "minItems"})


def _optional(node: dict[str, Any]) -> dict[str, Any]:
    """`{"anyOf": [X, {"type": "null"}], "default": null, ...}` (pydantic's optional field) as X with
    the field's other keys: the field is not required, which already says it may be left out."""
    options = node.get("anyOf")
    if not (isinstance(options, list) and len(options) == 2 and {"type": "null"} in options):
        return node
    if node.get("default", ...) is not None:
        return node
    [kept] = [o for o in options if o != {"type": "null"}]
    rest = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
    return {**kept, **rest}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON Schema of a model as a tool `input_schema`: no titles, no model docstrings, no size
    limits and no spelled-out null for optional fields (they only cost tokens)."""

    def strip(node: Any, names: bool = False) -> Any:
        # Under "properties" the keys are field names (TaskSpec has a field called "title").
        if isinstance(node, dict):
            if not names:
                node = _optional(node)
            return {
                k: strip(v, names=k in ("properties", "$defs"))
                for k, v in node.items()
                if names or not ((k == "title" and isinstance(v, str)) or k in _SIZE_LIMITS)
            }
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    schema: dict[str, Any] = strip(model.model_json_schema())
    # A model's docstring (its schema's description) is written for whoever reads the code; the
    # fields' own descriptions are what the model needs, and every token of a tool is paid per call.
    schema.pop("description", None)
    for definition in schema.get("$defs", {}).values():
        definition.pop("description", None)
    return schema
