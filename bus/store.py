"""Goal, plan and task state in Redis, changed only by atomic, state-machine-checked scripts.

Layout (all keys from `bus.keys`):
* goal hash: `state`, `record` (the immutable GoalRecord core as JSON), `plan_version`, `replans`,
  `answer`, `reason`, `updated_at`;
* one hash per task: `state`, `attempt`, `plan_version`, `reason`, `feedback`, `updated_at`,
  plus a set of the goal's task ids;
* plans as JSON strings, one key per version, never overwritten.

Each transition is one Lua script that reads the current state, checks it against the state
machine of `bus.schemas` (the allowed source states are passed in), writes the new state and
appends the event to the goal's and the global stream. The scripts never parse JSON, so no record
can be mangled by Lua's cjson (which, for one, turns an empty list into an object).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from llm.types import ModelResponse

from . import events as ev
from .batch import ScriptCall, run_scripts, run_scripts_and_reads
from .keys import Keys
from .ledger import end_grant
from .memo import Memo, hand_over_goal, is_handed_over, take_handed_over, take_handed_over_with_task
from .replies import as_str
from .schemas import (
    GOAL_RESUMABLE,
    GOAL_TERMINAL,
    GOAL_TRANSITIONS,
    RESUME_RESETS,
    TASK_TERMINAL,
    TASK_TRANSITIONS,
    Event,
    GoalRecord,
    GoalState,
    Plan,
    PlanRoute,
    StoredPlan,
    TaskProgress,
    TaskRecord,
    TaskResult,
    TaskState,
    goal_sources,
    task_sources,
    utcnow,
)
from .scripts import module_scripts, registered
from .store_errors import AlreadyExists, CorruptRecord, IllegalTransition, NotFound, StaleWrite, StoreError, corrupt
from .store_records import (
    csv,
    goal_from_hash,
    plan_from_json,
    progress_from_reply,
    result_from_json,
    task_from_hash,
    transition_outcome,
)

log = structlog.get_logger("taskloom.store")

# The scripts (bus/lua/): each file's header says its KEYS, ARGV and reply.
_TRANSITION, _CREATE_GOAL, _SAVE_PLAN, _CANCEL, _RESUME, _CLAIM_STALE, _PROGRESS = module_scripts(
    "store", "transition", "create_goal", "save_plan", "cancel", "resume", "claim_stale", "progress"
)


# redis-py types the asyncio client's hash/set commands as `Awaitable[T] | T`; the
# `type: ignore[misc]` comments below are for that, not for anything of ours.


@dataclass(frozen=True)
class TaskMove:
    """A task transition ready to send (`Store.task_move`): the script call and how to read its reply."""

    entity: str
    target: str
    expected_attempt: int | None
    call: ScriptCall


class Store:
    def __init__(self, redis: Redis, keys: Keys, events_maxlen: int = 10_000) -> None:
        self.redis = redis
        self.keys = keys
        self.maxlen = events_maxlen
        # goal id -> its deadline (None: it has none), from any goal read: `expire_if_late`, which
        # every job runs first, then needs no read of its own for a goal this process has seen.
        self._deadlines = Memo()
        self._plans = Memo()  # (goal id, version) -> StoredPlan
        self._transition = registered(redis, _TRANSITION)
        self._create_goal = registered(redis, _CREATE_GOAL)
        self._save_plan = registered(redis, _SAVE_PLAN)
        self._cancel = registered(redis, _CANCEL)
        self._claim_stale = registered(redis, _CLAIM_STALE)
        self._resume = registered(redis, _RESUME)
        self._progress = registered(redis, _PROGRESS)

    def _task_key(self, goal_id: str, task_id: str) -> str:
        return self.keys.task(goal_id, task_id)

    def _task_ids_key(self, goal_id: str) -> str:
        return self.keys.task_ids(goal_id)

    def _streams(self, goal_id: str) -> list[str]:
        return [self.keys.goal_events(goal_id), self.keys.global_events()]

    # -- goals --------------------------------------------------------------------------------
    async def create_goal(self, record: GoalRecord, event_data: dict[str, Any] | None = None) -> bool:
        """Store a new goal in `submitted`; False (and nothing written) if the id exists."""
        core = record.model_dump_json(include={"id", "goal", "budget_tokens", "created_at", "traceparent"})
        event = Event(type="goal.submitted", goal_id=record.id, data=event_data or {})
        created = await self._create_goal(
            keys=[
                self.keys.goal(record.id),
                self.keys.goal_index(),
                self.keys.submitted_index(),
                *self._streams(record.id),
                self.keys.active_index(),
            ],
            args=[
                record.id,
                core,
                record.state.value,
                record.created_at.timestamp(),
                record.updated_at.isoformat(),
                ev.encode(event),
                self.maxlen,
            ],
        )
        return bool(created)

    async def get_goal(self, goal_id: str) -> GoalRecord:
        fresh = take_handed_over(goal_id)
        if fresh is not None:
            return fresh
        try:
            raw = await self.redis.hgetall(self.keys.goal(goal_id))  # type: ignore[misc]
        except ResponseError as exc:  # WRONGTYPE: the key holds something other than a goal hash
            raise corrupt("goal", self.keys.goal(goal_id), exc) from None
        return self._goal_record(goal_id, raw)

    async def get_goal_and_task(
        self, goal_id: str, task_id: str, *, result_of: int | None = None
    ) -> tuple[GoalRecord, TaskRecord, TaskResult | None]:
        """`get_goal` and `get_task` in one round trip, with the stored result of attempt `result_of`
        (None when not asked for, or none is stored).

        The task is read before the result: an executor stores the result before it moves the
        task to review, so a task seen in review has its result in the read that follows."""
        task_key = self._task_key(goal_id, task_id)
        field = self.keys.result_field(task_id, result_of) if result_of is not None else None

        def reads(pipe: Any) -> None:
            pipe.hgetall(task_key)
            if field is not None:
                pipe.hget(self.keys.results(goal_id), field)

        held = take_handed_over_with_task(goal_id, task_id) if field is None else None
        if held is not None:  # the job wrapper read both an instant ago, in one round trip
            goal, replies = held[0], [held[1]]
        else:
            goal, replies = await self._goal_with(goal_id, reads)
        task_raw = replies[0]
        if isinstance(task_raw, ResponseError):
            raise corrupt("task", task_key, task_raw)
        if not task_raw:
            raise NotFound("task", f"{goal_id}/{task_id}")
        task = self._task_record(goal_id, task_id, task_raw)
        if result_of is None:
            return goal, task, None
        raw = replies[1]
        if isinstance(raw, ResponseError):
            raise corrupt("results", self.keys.results(goal_id), raw)
        return goal, task, self.parse_result(goal_id, task_id, result_of, raw)

    async def _goal_with(self, goal_id: str, reads: Any) -> tuple[GoalRecord, list[Any]]:
        """The goal record (from the job's hand-over when it has one, else read) and the replies of
        the reads `reads(pipe)` queues, in one round trip; an error reply is returned, not raised."""
        if is_handed_over(goal_id):
            goal = await self.get_goal(goal_id)
            async with self.redis.pipeline(transaction=False) as pipe:
                reads(pipe)
                return goal, list(await pipe.execute(raise_on_error=False))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.goal(goal_id))
            reads(pipe)
            goal_raw, *replies = await pipe.execute(raise_on_error=False)
        if isinstance(goal_raw, ResponseError):
            raise corrupt("goal", self.keys.goal(goal_id), goal_raw)
        return self._goal_record(goal_id, goal_raw), replies

    def _goal_record(self, goal_id: str, raw: dict[Any, Any]) -> GoalRecord:
        record = goal_from_hash(self.keys.goal(goal_id), goal_id, raw)
        self._deadlines.put(goal_id, record.goal.deadline)
        return record

    async def transition_goal(
        self,
        goal_id: str,
        target: GoalState,
        *,
        reason: str | None = None,
        answer: str | None = None,
        data: dict[str, Any] | None = None,
        fields: dict[str, str | int] | None = None,
        causes: Sequence[Event] = (),
    ) -> bool:
        """Move a goal to `target`. True if it moved, False if it was already there (idempotent).

        Raises `IllegalTransition` (nothing written) when the state machine forbids it. `causes`:
        events appended just before the `goal.state` event, atomically with the move and only if it
        moves (the final verdict that ends the goal: a reader that sees `succeeded` has it too).
        """
        patch: dict[str, str | int] = {"updated_at": utcnow().isoformat(), **(fields or {})}
        if reason is not None:
            patch["reason"] = reason
        if answer is not None:
            patch["answer"] = answer
        event = Event(
            type="goal.state",
            goal_id=goal_id,
            data={"state": target.value, **({"reason": reason} if reason else {}), **(data or {})},
        )
        # Any move out of `submitted` also takes the goal off the reconciler's list, atomically.
        out = await self._run_transition(
            self.keys.goal(goal_id),
            goal_id,
            target.value,
            goal_sources(target),
            None,
            event,
            patch,
            leave=(self.keys.submitted_index(), goal_id),
            causes=causes,
        )
        moved = transition_outcome(out, f"goal {goal_id}", target.value)
        if moved and target in GOAL_TERMINAL:
            await self._ended(goal_id)
        return moved

    async def expire_if_late(
        self, goal_id: str, now: datetime | None = None, *, hand_over: bool = False, task_id: str | None = None
    ) -> bool:
        """Fail a goal whose own deadline (`Goal.deadline`) has passed. True if this call failed it.

        Every job checks this before its handler runs, so a late goal stops at its next hop; an
        executor also stops an attempt at the deadline between steps. `hand_over` (the job wrapper):
        a goal record read here serves the next `get_goal` of the same task, if it comes at once;
        `task_id`: the job's handler reads that task with its goal first thing (`get_goal_and_task`),
        so it is read here too, in the same round trip, and handed over with the goal.
        """
        if goal_id in self._deadlines:  # known without a read: a goal's deadline never changes
            known = self._deadlines[goal_id]
            if known is None or (now or utcnow()) <= known:
                return False
        task: tuple[str, Any] | None = None
        if hand_over and task_id is not None:
            task_key = self._task_key(goal_id, task_id)
            goal, (task_raw,) = await self._goal_with(goal_id, lambda pipe: pipe.hgetall(task_key))
            task = (task_id, task_raw)  # checked where it is used, as a read of its own would be
        else:
            goal = await self.get_goal(goal_id)
        deadline = goal.goal.deadline
        if deadline is None or goal.terminal or (now or utcnow()) <= deadline:
            if hand_over:
                # Every handler reads its goal first thing: it gets this record (read an instant
                # ago, in the same job) instead of a second read.
                hand_over_goal(goal, task)
            return False
        try:
            return await self.transition_goal(
                goal_id, GoalState.FAILED, reason=f"deadline {deadline.isoformat()} passed"
            )
        except IllegalTransition:
            return False  # it ended meanwhile

    async def resume_goal(
        self, goal_id: str, budget_tokens: int | None = None, forget: Sequence[str] = ()
    ) -> GoalState | None:
        """Restart a `failed` or `budget_exhausted` goal: `planning` when it never got a plan, else
        `running`, with its accepted tasks kept and the others back to `pending`. Returns the new
        state, or None when the goal is already moving again (idempotent). Raises `IllegalTransition`
        for a succeeded or cancelled goal, and `ValueError` when `budget_tokens` does not exceed what
        the goal has spent (and holds reserved). `forget`: result keys of goal-level jobs to void.
        """
        event = Event(type="goal.state", goal_id=goal_id, data={"state": "__TARGET__", "resumed": True})
        out = await self._resume(
            keys=[
                self.keys.goal(goal_id),
                self._task_ids_key(goal_id),
                *self._streams(goal_id),
                self.keys.active_index(),
                self.keys.provider_trouble(goal_id),
                self.keys.ledger(goal_id),
                *forget,
            ],
            args=[
                utcnow().isoformat(),
                ev.encode(event),
                self.maxlen,
                self.keys.task_prefix(goal_id),
                goal_id,
                f"{time.time():.3f}",
                "" if budget_tokens is None else str(budget_tokens),
                csv(s.value for s in RESUME_RESETS),
                csv(s.value for s in GOAL_RESUMABLE),
                csv(s.value for s in GOAL_TERMINAL),
            ],
        )
        tag = as_str(out[0])
        if tag == "missing":
            raise NotFound("goal", goal_id)
        if tag == "illegal":
            raise IllegalTransition(f"goal {goal_id}", as_str(out[1]), "resumed")
        if tag == "budget":
            raise ValueError(f"budget_tokens must exceed what the goal has spent and reserved ({as_str(out[1])})")
        if tag == "same":
            return None
        return GoalState(as_str(out[2]))

    async def stale_goals(self, idle_for: float, limit: int = 200) -> list[str]:
        """Non-terminal goals that made no progress for `idle_for` seconds, each claimed (for another
        `idle_for`) by this caller alone: the supervisor's work list, read without a SCAN."""
        now = time.time()
        cutoff = now - idle_for
        ids = await self.redis.zrangebyscore(self.keys.active_index(), "-inf", cutoff, start=0, num=limit)
        claimed = []
        for raw in ids:
            gid = as_str(raw)
            if await self._claim_stale(keys=[self.keys.active_index()], args=[gid, cutoff, f"{now:.3f}"]):
                claimed.append(gid)
        return claimed

    async def drop_inactive(self, goal_id: str) -> None:
        """Take an ended (or vanished) goal off the supervisor's index."""
        await self.redis.zrem(self.keys.active_index(), goal_id)

    async def cancel_goal(self, goal_id: str, reason: str = "cancelled by request") -> bool:
        """Cancel the goal and all its unfinished tasks atomically. False if already cancelled."""
        now = utcnow().isoformat()
        event = Event(type="goal.state", goal_id=goal_id, data={"state": "cancelled", "reason": reason})
        out = await self._cancel(
            keys=[
                self.keys.goal(goal_id),
                self._task_ids_key(goal_id),
                *self._streams(goal_id),
                self.keys.submitted_index(),
                self.keys.active_index(),
            ],
            args=[
                csv(goal_sources(GoalState.CANCELLED)),
                csv(s.value for s in TASK_TERMINAL),
                reason,
                now,
                ev.encode(event),
                self.maxlen,
                self.keys.task_prefix(goal_id),
                goal_id,
            ],
        )
        moved = transition_outcome(out, f"goal {goal_id}", GoalState.CANCELLED.value)
        if moved:
            await self._ended(goal_id)
        return moved

    async def _ended(self, goal_id: str) -> None:
        # An ended goal gives back what its grant of the tenant's pool holds (bus.ledger, module doc:
        # grants), so a tenant's grants are those of its goals that run. Not in the move's script: a
        # crash between the two, or a failure here, leaves the grant to the next report (a read of the
        # tenant, a goal short of room, retention), which gives it back the same way; so a failure is
        # logged, not raised into a move that is done.
        try:
            await end_grant(self.redis, self.keys, goal_id)
        except (RedisError, OSError) as exc:
            log.warning("ledger.end_grant_failed", goal_id=goal_id, error=repr(exc))

    # -- plans --------------------------------------------------------------------------------
    async def save_plan(
        self,
        goal_id: str,
        plan: Plan,
        expected_version: int,
        reason: str = "",
        *,
        route: PlanRoute = "plan",
        first_turn: ModelResponse | None = None,
    ) -> int:
        """Store `plan` as version `expected_version + 1` and create pending tasks for new ids.

        A planner job re-run after a crash passes the version it saw; if the plan was already
        stored, it gets `StaleWrite` instead of a duplicate version. A routed plan carries the
        planner's model turn (`first_turn`) in the same write.
        """
        version = expected_version + 1
        stored = StoredPlan(
            goal_id=goal_id, version=version, plan=plan, reason=reason, route=route, first_turn=first_turn
        )
        event = Event(
            type="plan.stored",
            goal_id=goal_id,
            data={"version": version, "tasks": [t.id for t in plan.tasks], "reason": reason, "route": route},
        )
        out = await self._save_plan(
            keys=[
                self.keys.goal(goal_id),
                self.keys.plan(goal_id, version),
                self._task_ids_key(goal_id),
                *self._streams(goal_id),
            ],
            args=[
                str(expected_version),
                stored.model_dump_json(),
                utcnow().isoformat(),
                ev.encode(event),
                self.maxlen,
                self.keys.task_prefix(goal_id),
                csv(s.value for s in GOAL_TERMINAL),
                *[t.id for t in plan.tasks],
            ],
        )
        tag = as_str(out[0])
        if tag == "missing":
            raise NotFound("goal", goal_id)
        if tag == "ended":
            raise IllegalTransition(f"goal {goal_id}", as_str(out[1]), "a new plan")
        if tag == "stale":
            raise StaleWrite(f"plan of goal {goal_id}", f"version {expected_version}", f"version {as_str(out[1])}")
        return int(as_str(out[1]))

    async def get_plan(self, goal_id: str, version: int | None = None) -> StoredPlan:
        if version is None:
            version = (await self.get_goal(goal_id)).plan_version
        known = self.known_plan(goal_id, version)
        if known is not None:
            return known  # a stored version is never overwritten (`save_plan` refuses a stale one)
        try:
            raw = await self.redis.get(self.keys.plan(goal_id, version)) if version else None
        except ResponseError as exc:
            raise corrupt("plan", self.keys.plan(goal_id, version), exc) from None
        if raw is None:
            raise NotFound("plan", f"{goal_id} v{version}")
        plan = plan_from_json(self.keys.plan(goal_id, version), raw)
        self._plans.put((goal_id, version), plan)
        return plan

    def known_plan(self, goal_id: str, version: int) -> StoredPlan | None:
        """Plan `version` of the goal when this process has read or stored it already (no round trip)."""
        known: StoredPlan | None = self._plans.get((goal_id, version))
        return known

    def plan_read(self, goal_id: str, version: int) -> tuple[str, str] | None:
        """The command that reads plan `version` of the goal, to send in a round trip the caller
        makes anyway (then `remember_plan` its reply); None when the plan is known already."""
        if not version or (goal_id, version) in self._plans:
            return None
        return ("GET", self.keys.plan(goal_id, version))

    def remember_plan(self, goal_id: str, version: int, raw: Any) -> None:
        """Keep the reply of `plan_read` for `get_plan`. A missing or damaged plan is not kept:
        `get_plan` reads it again and raises the error that names it."""
        if isinstance(raw, (bytes, str)):
            try:
                self._plans.put((goal_id, version), plan_from_json(self.keys.plan(goal_id, version), raw))
            except CorruptRecord:
                pass

    # -- tasks --------------------------------------------------------------------------------
    async def get_task(self, goal_id: str, task_id: str) -> TaskRecord:
        raw = await self.redis.hgetall(self._task_key(goal_id, task_id))  # type: ignore[misc]
        if not raw:
            raise NotFound("task", f"{goal_id}/{task_id}")
        return self._task_record(goal_id, task_id, raw)

    async def get_tasks(self, goal_id: str, ids: Iterable[str] | None = None) -> dict[str, TaskRecord]:
        """The goal's task records, or only those of `ids` (the tasks of a plan, whose records its
        store wrote with it: one round trip instead of two); a task without a record is left out."""
        if ids is None:
            ids = await self.redis.smembers(self._task_ids_key(goal_id))  # type: ignore[misc]
        ids = sorted({as_str(i) for i in ids})
        async with self.redis.pipeline(transaction=False) as pipe:
            for tid in ids:
                pipe.hgetall(self._task_key(goal_id, tid))
            rows = await pipe.execute()
        return {tid: self._task_record(goal_id, tid, raw) for tid, raw in zip(ids, rows, strict=True) if raw}

    async def get_progress(self, goal_id: str, ids: Iterable[str]) -> dict[str, TaskProgress]:
        """The state and attempt of the tasks `ids` (a plan's), in one read of those two fields per
        task (`bus/lua/store_progress.lua`); a task without a record is left out. A third of a whole
        records read's client CPU: the critic asks it at every review, of every task of the plan."""
        wanted = sorted(set(ids))
        keys = [self._task_key(goal_id, tid) for tid in wanted]
        (reply,), _ = await run_scripts_and_reads(self.redis, [ScriptCall(self._progress, keys, ())], ())
        return progress_from_reply(keys, wanted, reply)

    async def get_goal_and_progress(
        self, goal_id: str, ids: Iterable[str]
    ) -> tuple[GoalRecord, dict[str, TaskProgress]]:
        """`get_goal` and `get_progress(goal_id, ids)` in one round trip (the goal from the job's
        hand-over when it has one)."""
        wanted = sorted(set(ids))
        keys = [self._task_key(goal_id, tid) for tid in wanted]
        call = ScriptCall(self._progress, keys, ())
        if is_handed_over(goal_id):
            goal = await self.get_goal(goal_id)
            (reply,), _ = await run_scripts_and_reads(self.redis, [call], ())
            return goal, progress_from_reply(keys, wanted, reply)
        # The tasks' script runs first, then the goal's read, in the same round trip.
        (reply,), (goal_raw,) = await run_scripts_and_reads(self.redis, [call], [("HGETALL", self.keys.goal(goal_id))])
        if isinstance(goal_raw, ResponseError):
            raise corrupt("goal", self.keys.goal(goal_id), goal_raw)
        goal = self._goal_record(goal_id, goal_raw)  # a dict: redis-py's reply callback for HGETALL
        return goal, progress_from_reply(keys, wanted, reply)

    def _task_record(self, goal_id: str, task_id: str, raw: dict[Any, Any]) -> TaskRecord:
        return task_from_hash(self._task_key(goal_id, task_id), goal_id, task_id, raw)

    def task_move(
        self,
        goal_id: str,
        task_id: str,
        target: TaskState,
        *,
        expected_attempt: int | None = None,
        attempt: int | None = None,
        reason: str | None = None,
        feedback: str | None = None,
        plan_version: int | None = None,
        expected_state: TaskState | None = None,
        first_attempt: int | None = None,
        data: dict[str, Any] | None = None,
        causes: Sequence[Event] = (),
    ) -> TaskMove:
        """The move of a task to `target`, to make with `transition_task` or, with others in one
        round trip, `transition_tasks`.

        `causes`: events appended just before the move's `task.state` event, in the same script and
        only if it moves (the critic's verdict that made it): never one without the other.

        `expected_attempt` fences the write: a worker holding an older attempt gets `StaleWrite`.
        `attempt` sets the new attempt number (dispatching a retry); `plan_version` re-homes a task
        that a replan keeps or brings back. `expected_state` narrows the legal sources to that one
        state, checked in the same script (a late writer cannot move a task that moved on).
        """
        sources = task_sources(target)
        if expected_state is not None:
            sources = sources & {expected_state}
        given = {
            "plan_version": plan_version,
            "first_attempt": first_attempt,
            "attempt": attempt,
            "reason": reason,
            "feedback": feedback,
        }
        patch = {"updated_at": utcnow().isoformat(), **{k: v for k, v in given.items() if v is not None}}
        event = Event(
            type="task.state",
            goal_id=goal_id,
            task_id=task_id,
            data={
                "state": target.value,
                **({"attempt": attempt} if attempt is not None else {}),
                **({"reason": reason} if reason else {}),
                **(data or {}),
            },
        )
        keys, args = self._transition_call(
            self._task_key(goal_id, task_id),
            goal_id,
            target.value,
            sources,
            expected_attempt,
            event,
            patch,
            causes=causes,
        )
        call = ScriptCall(self._transition, keys, args)
        return TaskMove(f"task {goal_id}/{task_id}", target.value, expected_attempt, call)

    async def transition_task(
        self,
        goal_id: str,
        task_id: str,
        target: TaskState,
        *,
        expected_attempt: int | None = None,
        attempt: int | None = None,
        reason: str | None = None,
        feedback: str | None = None,
        plan_version: int | None = None,
        expected_state: TaskState | None = None,
        first_attempt: int | None = None,
        data: dict[str, Any] | None = None,
        causes: Sequence[Event] = (),
    ) -> bool:
        """Move a task to `target` (`task_move` says how). True if it moved, False if it was already there."""
        move = self.task_move(
            goal_id,
            task_id,
            target,
            expected_attempt=expected_attempt,
            attempt=attempt,
            reason=reason,
            feedback=feedback,
            plan_version=plan_version,
            expected_state=expected_state,
            first_attempt=first_attempt,
            data=data,
            causes=causes,
        )
        return self.move_outcome(move, await move.call.script(keys=move.call.keys, args=move.call.args))

    def move_outcome(self, move: TaskMove, reply: Any) -> bool:
        """What `transition_task` returns or raises for `move`, from the reply of its script sent
        elsewhere (`bus.batch`); an exception in place of the reply (Redis trouble) is raised."""
        if isinstance(reply, BaseException):
            raise reply
        return transition_outcome(reply, move.entity, move.target, move.expected_attempt)

    async def transition_tasks(self, moves: Sequence[TaskMove]) -> list[bool | StoreError]:
        """Make independent task moves in one round trip, each atomic on its own: for each, True
        (moved), False (already there) or the error `transition_task` would raise (not raised)."""
        replies = await run_scripts(self.redis, [m.call for m in moves])
        out: list[bool | StoreError] = []
        for move, reply in zip(moves, replies, strict=True):
            try:
                out.append(self.move_outcome(move, reply))  # Redis trouble in `reply` is raised
            except StoreError as exc:
                out.append(exc)
        return out

    # -- results ------------------------------------------------------------------------------
    async def latest_results(
        self,
        goal_id: str,
        task_ids: Iterable[str],
        records: Mapping[str, TaskRecord] | None = None,
        *,
        done_only: bool = False,
    ) -> dict[str, TaskResult | None]:
        """Each task's result of its current attempt (None: never run, not stored, or, with
        `done_only`, not accepted); `records` as just read by the caller, else read here."""
        if records is None:
            records = await self.get_tasks(goal_id)
        wanted: dict[str, int] = {}
        for tid in task_ids:
            rec = records.get(tid)
            if rec is not None and rec.attempt >= 1 and (not done_only or rec.state is TaskState.DONE):
                wanted[tid] = rec.attempt
        found = await self.get_results(goal_id, list(wanted.items()))
        return {tid: found.get((tid, wanted[tid])) if tid in wanted else None for tid in task_ids}

    async def get_result(self, goal_id: str, task_id: str, attempt: int) -> TaskResult | None:
        raw = await self.redis.hget(self.keys.results(goal_id), self.keys.result_field(task_id, attempt))  # type: ignore[misc]
        return self.parse_result(goal_id, task_id, attempt, raw)

    async def get_results(
        self, goal_id: str, attempts: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], TaskResult | None]:
        """The stored results of several (task id, attempt), in one read (they are fields of one hash)."""
        if not attempts:
            return {}
        fields = [self.keys.result_field(tid, attempt) for tid, attempt in attempts]
        raws = await self.redis.hmget(self.keys.results(goal_id), fields)  # type: ignore[misc]
        return {
            (tid, attempt): self.parse_result(goal_id, tid, attempt, raw)
            for (tid, attempt), raw in zip(attempts, raws, strict=True)
        }

    async def all_results(self, goal_id: str) -> list[TaskResult]:
        """Every stored result of the goal's tasks, of every attempt (in no particular order)."""
        raw = await self.redis.hgetall(self.keys.results(goal_id))  # type: ignore[misc]
        key = self.keys.results(goal_id)
        return [result_from_json(key, as_str(field), value) for field, value in raw.items()]

    def parse_result(self, goal_id: str, task_id: str, attempt: int, raw: bytes | str | None) -> TaskResult | None:
        """A stored result as read from the results hash (None: none stored)."""
        if raw is None:
            return None
        return result_from_json(self.keys.results(goal_id), self.keys.result_field(task_id, attempt), raw)

    # -- internals ----------------------------------------------------------------------------
    async def _run_transition(
        self,
        key: str,
        goal_id: str,
        target: str,
        sources: frozenset[Any],
        expected_attempt: int | None,
        event: Event,
        patch: dict[str, str | int],
        leave: tuple[str, str] | None = None,
        causes: Sequence[Event] = (),
    ) -> list[Any]:
        keys, args = self._transition_call(
            key, goal_id, target, sources, expected_attempt, event, patch, leave=leave, causes=causes
        )
        out: list[Any] = await self._transition(keys=keys, args=args)
        return out

    def _transition_call(
        self,
        key: str,
        goal_id: str,
        target: str,
        sources: frozenset[Any],
        expected_attempt: int | None,
        event: Event,
        patch: dict[str, str | int],
        leave: tuple[str, str] | None = None,
        causes: Sequence[Event] = (),
    ) -> tuple[list[str], list[str | int]]:
        ended = key == self.keys.goal(goal_id) and target in {s.value for s in GOAL_TERMINAL}
        args: list[str | int] = [
            target,
            csv(s.value for s in sources),
            "" if expected_attempt is None else str(expected_attempt),
            # Compact JSON has no raw newline: one event per line. The causes (a verdict) come first,
            # in the same script as the move, so a reader that sees the new state has seen them too.
            "\n".join(ev.encode(e) for e in (*causes, event)),
            self.maxlen,
            leave[1] if leave else "",
            goal_id,
            # Every move of the goal or one of its tasks is progress: the supervisor looks only at
            # goals whose last progress is older than its bound.
            "remove" if ended else f"{time.time():.3f}",
        ]
        for k, v in patch.items():
            args += [k, v]
        leave_key = leave[0] if leave else self.keys.submitted_index()  # untouched when ARGV[6] is ''
        keys = [key, *self._streams(goal_id), leave_key, self.keys.active_index()]
        return keys, args


__all__ = [
    "GOAL_TRANSITIONS",
    "TASK_TRANSITIONS",
    "AlreadyExists",
    "CorruptRecord",
    "IllegalTransition",
    "NotFound",
    "StaleWrite",
    "Store",
    "StoreError",
]
