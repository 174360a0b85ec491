"""What a job handler gets to work with: the shared Redis-backed services and limits, built once per
worker process by the composition root (`taskloom.workers`)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog
from arq.connections import ArqRedis
from pydantic import BaseModel, ConfigDict, Field

from llm.port import ModelPort
from llm.types import ToolDef

from .events import EventLog
from .jobs import Jobs
from .keys import Keys
from .ledger import BudgetExhausted, Ledger
from .live import LivePublisher
from .renewals import Renewals
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

    def for_goal(
        self, goal_id: str, role: str | None = None, choice: str | None = None, *, hold_settles: bool = False
    ) -> ModelPort: ...


class Limits(BaseModel):
    """Bounds every role respects. Defined once: `taskloom.settings.Settings` inherits these fields,
    so each is also a `TASKLOOM_*` variable with the same default and range."""

    model_config = ConfigDict(frozen=True)

    max_steps: int = Field(default=12, ge=1, le=1000, description="model turns per task attempt")
    task_timeout: float = Field(default=300, gt=0, description="wall-clock limit of one task attempt, s")
    model_max_tokens: int = Field(
        default=1024, ge=16, le=64_000, description="max_tokens asked per model call (the ledger may clamp it lower)"
    )
    max_task_retries: int = Field(
        default=2, ge=0, le=20, description="retries per task before the critic asks for a replan"
    )
    max_replans: int = Field(default=2, ge=0, le=20, description="replans per goal before it fails")
    max_plan_tasks: int = Field(default=20, ge=1, le=200, description="tasks per plan")
    max_plan_attempts: int = Field(default=3, ge=1, le=20, description="invalid plans sent back before the goal fails")
    tool_output_limit: int = Field(default=4000, ge=100, description="characters of one observation the model sees")
    tool_timeout: float = Field(default=30, gt=0, description="default seconds per tool call")
    lease_ttl: float = Field(default=15, ge=1, le=600, description="a dead executor's task resumes after ~this")
    compact_after_tokens: int = Field(
        default=20_000, ge=1000, description="condense older observations once a prompt's estimate passes this"
    )
    dependency_result_limit: int = Field(default=2000, ge=100, description="characters of each dependency's result")
    loop_window: int = Field(default=8, ge=1, le=100, description="repeated identical call within this many = loop")
    tool_error_retries: int = Field(
        default=2, ge=0, le=20, description="identical retries of a failed tool call before a repeat counts as a loop"
    )
    # Large catalogs (MCP servers): offer the planner and each task at most this many tools, picked
    # by the goal's or task's words (`llm.toolselect`); a smaller catalog is offered whole. 0 = all.
    tool_select_limit: int = Field(default=16, ge=0, le=1000, description="tools offered per goal/task (0 = all)")

    @classmethod
    def of(cls, source: object) -> Limits:
        """The limits carried by `source` (the settings, which inherit every field)."""
        return cls(**{name: getattr(source, name) for name in cls.model_fields})


# The defaults, for a component built without settings (a test, a benchmark): never spelled again.
DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Runtime:
    redis: ArqRedis
    keys: Keys
    store: Store
    events: EventLog
    jobs: Jobs
    models: ModelSource | None = None
    limits: Limits = field(default_factory=Limits)
    tool_catalog: tuple[ToolDef, ...] = ()  # every loaded tool, for the planner's prompt (fixed)
    tools: ToolDefinitions | None = None  # or the live catalog the executors use, when set
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # the job layer's retries (bus.retry)
    # The process's batched lease renewals (bus.renewals); None: each hold renews on its own.
    renewals: Renewals | None = None
    # Where the executors' model calls stream their words (bus.live); None: no live text.
    live: LivePublisher | None = None
    # The models' ledger (`build` takes it from them): its held settles ride on the attempts' writes
    # and are flushed before a result is stored (bus.ledger). None: no model.
    ledger: Ledger | None = None

    @classmethod
    def build(cls, redis: ArqRedis, keys: Keys, events_maxlen: int = 10_000, **extra: Any) -> Runtime:
        extra.setdefault("renewals", Renewals(redis))
        extra.setdefault("ledger", getattr(extra.get("models"), "ledger", None))
        return cls(
            redis=redis,
            keys=keys,
            store=Store(redis, keys, events_maxlen),
            events=EventLog(redis, keys, events_maxlen),
            jobs=Jobs(redis, keys),
            **extra,
        )

    def renewer(self) -> Renewals:
        """The process's renewals, or a fresh set for a runtime built without them."""
        return self.renewals if self.renewals is not None else Renewals(self.redis)

    async def within_budget(self, goal_id: str, call: Awaitable[T]) -> T | None:
        """Await a model-calling coroutine; when the ledger refuses it, end the goal `budget_exhausted`
        (keeping every accepted result) and return None instead of failing the job."""
        try:
            return await call
        except BudgetExhausted as exc:
            await self.budget_exhausted(goal_id, str(exc))
            return None

    async def budget_exhausted(self, goal_id: str, reason: str) -> None:
        """The one way a goal ends for want of budget (every role comes here): `budget_exhausted`,
        keeping every accepted result, so that `taskloom resume --budget` can continue it."""
        log.warning("goal.budget_exhausted", goal_id=goal_id, detail=reason)
        with contextlib.suppress(IllegalTransition):  # it ended another way meanwhile
            await self.store.transition_goal(goal_id, GoalState.BUDGET_EXHAUSTED, reason=reason)

    async def tool_definitions(self) -> list[ToolDef]:
        """Every tool the planner may assign: the same catalog the executors run from."""
        return await self.tools.definitions() if self.tools is not None else list(self.tool_catalog)

    def model_for(
        self, goal_id: str, role: str | None = None, choice: str | None = None, *, hold_settles: bool = False
    ) -> ModelPort:
        """The metered model of `role`'s calls for the goal; `choice` is the model alias the goal
        asked for at submit (None: the role's configured model). `hold_settles`: its calls' settles
        may ride on later reserves (`bus.ledger`, held settles); await `flush_settles` before storing
        what they produced."""
        if self.models is None:
            raise RuntimeError("this worker was started without a model")
        return self.models.for_goal(goal_id, role, choice, hold_settles=hold_settles)

    async def flush_settles(self) -> None:
        """Close every settle this process holds: the goals' books are exact after it."""
        if self.ledger is not None:
            await self.ledger.flush()
