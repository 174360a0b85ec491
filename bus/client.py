"""The application's handle on taskloom: submit goals, read them, wait for them, follow and cancel them."""

from __future__ import annotations

import contextlib
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from arq.connections import ArqRedis
from arq.constants import result_key_prefix
from opentelemetry.trace import SpanKind
from pydantic import BaseModel, ConfigDict

from . import tracing
from .approvals import AlreadyDecided, ApprovalBook, ApprovalDecision, PendingApproval
from .connection import connect
from .events import EventLog
from .jobs import ExecuteJob, JobPayload, Jobs, PlanJob, ReplanJob, ReviewGoalJob
from .keys import Keys
from .ledger import Ledger
from .replies import as_str
from .schemas import GOAL_ID_PATTERN, Event, Goal, GoalRecord, StoredPlan, TaskRecord
from .store import AlreadyExists, NotFound, Store
from .synthesis import accepted_key
from .tenants import Period, Tenants, TenantSettings, TenantView


class WaitTimeout(TimeoutError):
    def __init__(self, goal_id: str, state: str, timeout: float) -> None:
        super().__init__(f"goal {goal_id} still {state} after {timeout:g} s")
        self.goal_id = goal_id
        self.state = state
        self.timeout = timeout

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.goal_id, self.state, self.timeout))


class GoalStatus(BaseModel):
    """A goal with its current plan and every task's state."""

    model_config = ConfigDict(frozen=True)

    goal: GoalRecord
    plan: StoredPlan | None
    tasks: list[TaskRecord]


def new_goal_id() -> str:
    return uuid.uuid4().hex


class Client:
    def __init__(self, redis: ArqRedis, keys: Keys, default_budget_tokens: int, events_maxlen: int = 10_000) -> None:
        self.redis = redis
        self.keys = keys
        self.default_budget_tokens = default_budget_tokens
        self.store = Store(redis, keys, events_maxlen)
        self.log = EventLog(redis, keys, events_maxlen)
        self.jobs = Jobs(redis, keys)
        self.ledger = Ledger(redis, keys)
        self.tenants = Tenants(redis, keys)
        self.approval_book = ApprovalBook(redis, keys, events_maxlen)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        redis_url: str | None,
        home: Path,
        keys: Keys | None = None,
        default_budget_tokens: int = 200_000,
    ) -> AsyncIterator[Client]:
        """A client on `redis_url`, or on the embedded server under `home` when it is None."""
        async with connect(redis_url, home) as redis:
            yield cls(redis, keys or Keys(), default_budget_tokens)

    async def submit(self, goal: Goal | Mapping[str, Any] | str, goal_id: str | None = None) -> str:
        """Validate, store and enqueue a goal; return its id.

        Invalid input raises pydantic's `ValidationError` naming the field, and nothing is stored.
        Passing your own `goal_id` makes submit idempotent: re-submitting the same goal under the
        same id stores nothing new and re-enqueues its planner job if it never started (the job
        id is deterministic, so this cannot plan twice).
        """
        gid, _ = await self.submit_once(goal, goal_id)
        return gid

    async def submit_once(
        self, goal: Goal | Mapping[str, Any] | str, goal_id: str | None = None
    ) -> tuple[str, bool]:
        """As `submit`, and whether this call stored the goal: of any number of concurrent calls with
        one `goal_id`, exactly one gets True (the store's atomic create decides), the others False."""
        if isinstance(goal, str):
            goal = Goal(text=goal)
        elif not isinstance(goal, Goal):
            goal = Goal.model_validate(goal)
        if goal_id is not None:
            # Raises naming `id` if it is not a valid goal id.
            GoalRecord.model_validate({"id": goal_id, "goal": goal, "budget_tokens": 1})
        gid = goal_id or new_goal_id()
        # The goal's root span: a child of the caller's current span if there is one (the goal joins
        # the caller's trace). Every job carries its context on, so the whole goal is one trace.
        with tracing.span("goal", {"taskloom.goal_id": gid}, kind=SpanKind.PRODUCER):
            record = GoalRecord(
                id=gid,
                goal=goal,
                budget_tokens=goal.budget_tokens or self.default_budget_tokens,
                traceparent=tracing.current_traceparent() or tracing.new_traceparent(),
            )
            # The books first (idempotent), so that no goal ever exists without its budget.
            await self.ledger.open(gid, record.budget_tokens, budget_usd=goal.budget_usd, tenant=goal.tenant)
            created = await self.store.create_goal(
                record, {"text": goal.text[:200], "review": goal.review, "check": goal.check is not None}
            )
            parent = None
            if not created:
                existing = await self.store.get_goal(gid)
                if existing.goal != goal:
                    raise AlreadyExists("goal", gid)
                parent = existing.traceparent  # a re-submit continues the goal's own trace
            # Stored first, then enqueued: if we crash in between, the planner's reconciler finds the
            # goal still `submitted` and enqueues it (see `reconcile`).
            await self.jobs.enqueue(PlanJob(goal_id=gid, traceparent=parent))
        return gid, created

    async def get(self, goal_id: str) -> GoalRecord:
        self._check_id(goal_id)
        return await self.store.get_goal(goal_id)

    async def status(self, goal_id: str) -> GoalStatus:
        goal = await self.get(goal_id)
        plan = await self.store.get_plan(goal_id) if goal.plan_version else None
        tasks = await self.store.get_tasks(goal_id)
        return GoalStatus(goal=goal, plan=plan, tasks=list(tasks.values()))

    async def wait(self, goal_id: str, timeout: float | None = None) -> GoalRecord:
        """Block until the goal ends (succeeded, failed, cancelled, budget_exhausted).

        Raises `WaitTimeout` after `timeout` seconds; `ValueError` for a timeout that is negative or
        not finite (it would wait forever, or not at all, without saying so)."""
        if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"timeout: expected a finite number of seconds >= 0, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        # Read state after noting the stream position, so no terminal event slips between them.
        tail = await self.redis.xrevrange(self.keys.goal_events(goal_id), count=1)
        after: str | None = as_str(tail[0][0]) if tail else None
        goal = await self.get(goal_id)
        while not goal.terminal:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(goal_id, goal.state.value, timeout or 0)
            block = 1000 if left is None else max(1, min(1000, int(left * 1000)))
            newest, moved = await self.log.next_position(goal_id, after, block, "goal.state")
            after = newest or after
            # Every change of the goal's state emits `goal.state` in the script that makes it: the
            # record is read again only then (or after a quiet second), not after every task event.
            if newest is None or moved:
                goal = await self.get(goal_id)
        return goal

    async def events(self, goal_id: str, after: str | None = None, follow: bool = True) -> AsyncIterator[Event]:
        """The goal's events after position `after`; with `follow`, keeps going until the goal ends.

        `after` is a position from an earlier event (`Event.position`); anything else raises `ValueError`."""
        if after is not None and not re.fullmatch(r"\d+(-\d+)?", after):
            raise ValueError(f"after: expected an event position like 1718000000000-0, got {after!r}")
        await self.get(goal_id)
        if not follow:
            for event in await self.log.read(goal_id, after=after):
                yield event
            return
        while True:
            batch = await self.log.read(goal_id, after=after, block_ms=500)
            for event in batch:
                after = event.position
                yield event
            if not batch and (await self.get(goal_id)).terminal:
                # Drain anything written between the read and the state check.
                for event in await self.log.read(goal_id, after=after):
                    yield event
                return

    # -- tenants (bus.tenants) -------------------------------------------------------------------
    async def tenant_set(
        self,
        name: str,
        *,
        period: Period | None = None,
        budget_tokens: int | None = None,
        budget_usd: float | None = None,
        max_running: int | None = None,
    ) -> TenantSettings:
        """Change a tenant's pool atomically (unset arguments keep their value; 0 = no limit)."""
        return await self.tenants.set(
            name, period=period, budget_tokens=budget_tokens, budget_usd=budget_usd, max_running=max_running
        )

    async def tenant_show(self, name: str) -> TenantView:
        """The tenant's settings, running slots and spend per period, model and kind."""
        return await self.tenants.show(name)

    async def tenant_list(self) -> list[TenantView]:
        return [await self.tenants.show(n, periods=1) for n in await self.tenants.names()]

    async def tenant_reset(self, name: str) -> str:
        """Start the tenant's current period afresh; returns the period pool's name."""
        return await self.tenants.reset(name)

    async def cancel(self, goal_id: str, reason: str = "cancelled by request") -> bool:
        """Cancel a goal and its unfinished tasks. False if it was already cancelled.

        Raises `IllegalTransition` if the goal already ended otherwise.
        """
        self._check_id(goal_id)
        return await self.store.cancel_goal(goal_id, reason)

    async def resume(self, goal_id: str, budget_tokens: int | None = None) -> GoalRecord:
        """Restart a `failed` or `budget_exhausted` goal (after an outage, or with a new budget).

        Accepted tasks are kept; the others are dispatched again as new attempts (a side effect an
        earlier attempt made is not repeated, see docs/internals.md); a goal that never got a plan
        is planned again. `budget_tokens` replaces the goal's budget and must exceed what it has
        spent. Idempotent: a goal already moving again is returned as it is. Raises
        `IllegalTransition` for a succeeded or cancelled goal, `NotFound` for an unknown one.
        """
        goal = await self.get(goal_id)
        # A span in the goal's own trace, so the resumed run's jobs are not orphans.
        with tracing.span("goal.resume", {"taskloom.goal_id": goal_id}, parent=goal.traceparent):
            return await self._resume(goal, budget_tokens)

    async def _resume(self, goal: GoalRecord, budget_tokens: int | None) -> GoalRecord:
        goal_id = goal.id
        version = max(1, goal.plan_version)
        # The goal-level jobs of the ended run keep their deterministic ids (and arq refuses an id
        # whose result it still keeps): their results are voided with the resume.
        ended_jobs: list[JobPayload] = [
            PlanJob(goal_id=goal_id),
            ReviewGoalJob(goal_id=goal_id, plan_version=version),
            ReplanJob(goal_id=goal_id, plan_version=version),
        ]
        if goal.plan_version >= 1:
            # The final answer's job is named after the accepted attempts (bus.synthesis): when every
            # task is done, the resumed run asks for it under the same id.
            stored = await self.store.get_plan(goal_id, goal.plan_version)
            key = accepted_key(stored.plan, await self.store.get_tasks(goal_id))
            if key is not None:
                ended_jobs.append(ReviewGoalJob(goal_id=goal_id, plan_version=version, attempts=key))
        forget = [f"{result_key_prefix}{self.jobs.job_id(job)}" for job in ended_jobs]
        target = await self.store.resume_goal(goal_id, budget_tokens, forget)
        if target is not None:
            # A plan job redoes planning, or (running) dispatches every pending task whose inputs are done.
            await self.jobs.enqueue(PlanJob(goal_id=goal_id, redrive=int(time.time() * 1000)))
        return await self.get(goal_id)

    async def approvals(self, goal_id: str) -> dict[str, dict[str, Any]]:
        """Tool calls of this goal waiting for a person's decision, by call id."""
        await self.get(goal_id)
        return await self.approval_book.requests(goal_id)

    async def decision(self, goal_id: str, call_id: str) -> str | None:
        """The decision recorded for a tool call: "approved", "denied:<reason>", or None if undecided."""
        return await self.approval_book.decision(goal_id, call_id)

    async def pending_approvals(self, limit: int = 100, goal_id: str | None = None) -> list[PendingApproval]:
        """Tool calls waiting for a decision across every goal that has not ended, oldest first."""
        return await self.approval_book.pending(limit, goal_id)

    async def decide(self, goal_id: str, call_id: str, approved: bool, reason: str = "", by: str | None = None) -> bool:
        """Approve or deny a tool call awaiting approval, and resume its task.

        The first decision wins: a later one raises `AlreadyDecided` (a `NotFound`: the request is
        gone), or returns False if two decisions race, and changes nothing. A denial reaches
        the model as an `ERROR` observation carrying `reason`. `by` (who decided: an API token's
        name, a user) is recorded in the `tool.approval_decided` audit event.
        """
        self._check_id(goal_id)
        requests = await self.approval_book.requests(goal_id)
        req = requests.get(call_id)
        if req is None:
            await self.get(goal_id)  # an unknown goal is named as such
            decided = await self.approval_book.decision(goal_id, call_id)
            if decided is not None:
                raise AlreadyDecided(goal_id, call_id, decided)
            raise NotFound("approval request", f"{goal_id}/{call_id}")
        decision = ApprovalDecision(approved=approved, reason=reason).encode()
        event = Event(
            type="tool.approval_decided",
            goal_id=goal_id,
            task_id=req["task_id"],
            data={"call_id": call_id, "approved": approved, "reason": reason, "by": by},
        )
        outcome = await self.approval_book.decide(goal_id, call_id, decision, event)
        if outcome == "decided":
            return False
        if outcome == "missing":
            raise NotFound("approval request", f"{goal_id}/{call_id}")
        # A new job id per decision: the attempt resumes from its stored steps.
        await self.jobs.enqueue(
            ExecuteJob(goal_id=goal_id, task_id=req["task_id"], attempt=req["attempt"], resume=int(time.time() * 1000))
        )
        return True

    @staticmethod
    def _check_id(goal_id: str) -> None:
        if not re.match(GOAL_ID_PATTERN, goal_id):
            raise NotFound("goal", goal_id)
