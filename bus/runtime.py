"""What a job handler gets to work with: the shared Redis-backed services and limits, built once per
worker process by the composition root (`taskloom.workers`)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog
from arq.connections import ArqRedis

from llm.port import ModelPort
from llm.types import ToolDef

from .events import EventLog
from .jobs import Jobs
from .keys import Keys
from .ledger import BudgetExhausted, Ledger
from .retry import RetryPolicy
from .schemas import GoalState
from .store import IllegalTransition, Store

T = TypeVar("T")
log = structlog.get_logger("taskloom.ledger")


class ToolDefinitions(Protocol):
    """The worker's current tool catalog (its MCP servers' lists can change while it runs)."""

    async def definitions(self) -> list[ToolDef]: ...


class ModelSource(Protocol):
    """Hands out the (metered) model a goal's calls must go through; the only way roles get a model."""

    def for_goal(self, goal_id: str) -> ModelPort: ...


@dataclass(frozen=True)
class Limits:
    """Bounds every role respects; from settings (`TASKLOOM_*`)."""

    max_steps: int = 12  # model turns per task attempt
    task_timeout: float = 300.0  # wall-clock seconds per task attempt
    model_max_tokens: int = 1024  # max_tokens asked per call (the ledger may clamp it lower)
    max_task_retries: int = 2  # retries per task before the critic asks for a replan
    max_replans: int = 2  # replans per goal before it fails
    max_plan_tasks: int = 20  # tasks per plan
    max_plan_attempts: int = 3  # invalid plans sent back before the goal fails
    tool_output_limit: int = 4000  # characters of one observation shown to the model
    tool_timeout: float = 30.0  # default per-call tool timeout, seconds
    dependency_result_limit: int = 2000  # characters of each dependency's result in a task's context
    loop_window: int = 8  # a repeated identical call within this many calls is a loop
    tool_select_limit: int = 16  # tools offered to the planner / a task at most, chosen by their words (0: all)
    compact_after_tokens: int = 20_000  # condense older steps once the prompt passes this estimate
    lease_ttl: float = 15.0  # a dead executor's task is picked up again after about this long


@dataclass(frozen=True)
class Runtime:
    redis: ArqRedis
    keys: Keys
    store: Store
    events: EventLog
    jobs: Jobs
    models: ModelSource | None = None
    ledger: Ledger | None = None
    limits: Limits = field(default_factory=Limits)
    tool_catalog: tuple[ToolDef, ...] = ()  # every loaded tool, for the planner's prompt (fixed)
    tools: ToolDefinitions | None = None  # or the live catalog the executors use, when set
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # the job layer's retries (bus.retry)

    @classmethod
    def build(cls, redis: ArqRedis, keys: Keys, events_maxlen: int = 10_000, **extra: Any) -> Runtime:
        return cls(
            redis=redis,
            keys=keys,
            store=Store(redis, keys, events_maxlen),
            events=EventLog(redis, keys, events_maxlen),
            jobs=Jobs(redis, keys),
            **extra,
        )

    async def within_budget(self, goal_id: str, call: Awaitable[T]) -> T | None:
        """Await a model-calling coroutine; when the ledger refuses it, end the goal `budget_exhausted`
        (keeping every accepted result) and return None instead of failing the job."""
        try:
            return await call
        except BudgetExhausted as exc:
            log.warning("goal.budget_exhausted", goal_id=goal_id, detail=str(exc))
            with contextlib.suppress(IllegalTransition):  # it ended another way meanwhile
                await self.store.transition_goal(goal_id, GoalState.BUDGET_EXHAUSTED, reason=str(exc))
            return None

    async def tool_definitions(self) -> list[ToolDef]:
        """Every tool the planner may assign: the same catalog the executors run from."""
        return await self.tools.definitions() if self.tools is not None else list(self.tool_catalog)

    def model_for(self, goal_id: str) -> ModelPort:
        if self.models is None:
            raise RuntimeError("this worker was started without a model")
        return self.models.for_goal(goal_id)
