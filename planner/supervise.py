"""The supervisor: no non-terminal goal or task stays without a live driver.

It runs in every planner worker. Each goal that has not made progress (no state change of it or of
one of its tasks) for `stale_after` seconds is claimed by one supervisor (`Store.stale_goals`, an
index of non-terminal goals, no SCAN) and checked: every goal and task state has a driver, the thing
that will move it (docs/internals.md has the table). When a driver is missing, the job that state
calls for is enqueued again under a fresh id (`redrive`), an event `goal.redriven` says so, and the
metric `taskloom_redrives_total` counts it. Every job handler is safe to run twice, so a redrive
that races a slow driver costs at most one idempotent no-op.

`needed_jobs` is the pure decision; `supervise` is its I/O shell.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog
from pydantic import ValidationError

from bus.approvals import ApprovalBook
from bus.attempts import leased
from bus.jobs import ExecuteJob, JobPayload, PlanJob, ReplanJob, ReviewGoalJob, ReviewJob
from bus.ledger import Ledger
from bus.observe import observe
from bus.runtime import Runtime
from bus.schemas import Event, GoalRecord, GoalState, Plan, TaskRecord, TaskState
from bus.store import CorruptRecord, IllegalTransition, NotFound

from .dag import all_done, ready_tasks

log = structlog.get_logger("taskloom.supervisor")


@dataclass(frozen=True)
class Drivers:
    """What is alive for one goal right now."""

    jobs: Mapping[str, bool]  # slot (`goal`, `task:<id>`) -> its last job is queued or running
    leased: frozenset[str]  # task ids whose running attempt is in the executors' lease set
    awaiting_person: frozenset[str]  # task ids with an approval request nobody answered yet
    last_replan: int | None = None  # plan version named by the last replan job enqueued, if any


def needed_jobs(
    goal: GoalRecord, plan: Plan | None, tasks: Mapping[str, TaskRecord], alive: Drivers
) -> list[JobPayload]:
    """The jobs to enqueue again so that every part of `goal` has a driver (empty: all is driven)."""
    gid = goal.id
    goal_driven = alive.jobs.get("goal", False)
    if goal.terminal:
        return []
    if goal.state in (GoalState.SUBMITTED, GoalState.PLANNING):
        return [] if goal_driven else [PlanJob(goal_id=gid)]
    if goal.state is GoalState.REPLANNING:
        if goal_driven:
            return []
        version = alive.last_replan if alive.last_replan is not None else goal.plan_version
        return [ReplanJob(goal_id=gid, plan_version=max(1, version), reason="re-driven by the supervisor")]
    if goal.state is GoalState.REVIEWING:
        return [] if goal_driven else [ReviewGoalJob(goal_id=gid, plan_version=max(1, goal.plan_version))]
    # running: each task of the current plan has its own driver; dispatch and the goal review are
    # the planner's (a plan job on a running goal redoes its dispatch, see planner.handlers._resume).
    jobs: list[JobPayload] = []
    if plan is None:
        return [] if goal_driven else [PlanJob(goal_id=gid)]
    states = {tid: rec.state for tid, rec in tasks.items()}
    dispatch = bool(ready_tasks(plan, states)) or all_done(plan, states)
    for spec in plan.tasks:
        rec = tasks.get(spec.id)
        if rec is None or alive.jobs.get(f"task:{spec.id}", False):
            continue
        if rec.state in (TaskState.READY, TaskState.RETRYING):
            jobs.append(ExecuteJob(goal_id=gid, task_id=spec.id, attempt=max(1, rec.attempt)))
        elif rec.state is TaskState.RUNNING and spec.id not in alive.leased:
            jobs.append(ExecuteJob(goal_id=gid, task_id=spec.id, attempt=max(1, rec.attempt)))
        elif rec.state is TaskState.WAITING_APPROVAL and spec.id not in alive.awaiting_person:
            jobs.append(ExecuteJob(goal_id=gid, task_id=spec.id, attempt=max(1, rec.attempt)))
        elif rec.state is TaskState.REVIEWING or (rec.state is TaskState.FAILED and rec.attempt >= 1):
            # A failed task of a running goal means its replan request was lost: the review's re-run
            # sends it again (critic.handlers._redrive).
            jobs.append(ReviewJob(goal_id=gid, task_id=spec.id, attempt=max(1, rec.attempt)))
    if dispatch and not goal_driven:
        jobs.append(PlanJob(goal_id=gid))
    return jobs


async def _drivers(rt: Runtime, goal_id: str, tasks: Mapping[str, TaskRecord]) -> Drivers:
    known = await rt.jobs.drivers(goal_id)
    jobs = {slot: alive for slot, (_, _, alive) in known.items()}
    goal_job = known.get("goal")
    last_replan = goal_job[1].plan_version if goal_job and isinstance(goal_job[1], ReplanJob) else None
    running = [t for t, rec in tasks.items() if rec.state is TaskState.RUNNING]
    held = await leased(rt.redis, rt.keys, goal_id, {t: tasks[t].attempt for t in running})
    waiting: set[str] = set()
    if any(rec.state is TaskState.WAITING_APPROVAL for rec in tasks.values()):
        waiting = await ApprovalBook(rt.redis, rt.keys).waiting_tasks(goal_id)
    return Drivers(jobs, frozenset(held), frozenset(waiting), last_replan)


async def check_goal(rt: Runtime, goal_id: str) -> list[JobPayload]:
    """Re-drive whatever part of one goal has no live driver; return the jobs enqueued."""
    try:
        goal = await rt.store.get_goal(goal_id)
    except NotFound:
        await rt.store.drop_inactive(goal_id)
        return []
    if goal.terminal:
        await rt.store.drop_inactive(goal_id)
        return []
    if await rt.store.expire_if_late(goal_id):
        return []  # its deadline passed: failed now, nothing to drive
    tasks = await rt.store.get_tasks(goal_id)
    plan = (await rt.store.get_plan(goal_id, goal.plan_version)).plan if goal.plan_version else None
    jobs = needed_jobs(goal, plan, tasks, await _drivers(rt, goal_id, tasks))
    stamp = int(time.time() * 1000)
    enqueued = []
    for job in jobs:
        fresh = job.model_copy(update={"redrive": stamp})
        if await rt.jobs.enqueue(fresh):
            enqueued.append(fresh)
            task_id = getattr(job, "task_id", None)
            log.warning(
                "supervisor.redrive", goal_id=goal_id, task_id=task_id, job=job.function, state=goal.state.value
            )
            _count_redrive(job.function)
            await rt.events.emit(
                Event(
                    type="goal.redriven",
                    goal_id=goal_id,
                    task_id=task_id,
                    data={"job": job.function, "goal_state": goal.state.value, "job_id": rt.jobs.job_id(fresh)},
                )
            )
    return enqueued


def _count_redrive(function: str) -> None:
    observe(lambda o: o.redrive(function))


async def supervise(rt: Runtime, stale_after: float, limit: int = 200) -> int:
    """One pass: check every goal idle for `stale_after` seconds. Returns how many jobs it enqueued.

    It also forfeits expired ledger reservations (their holders died): a reserve sweeps them only
    when it is short of room, so this pass is what keeps idle books and pools exact."""
    swept = await Ledger(rt.redis, rt.keys).sweep()
    if swept:
        log.info("supervisor.ledger_swept", reservations=swept)
    n = 0
    for goal_id in await rt.store.stale_goals(stale_after, limit):
        try:
            n += len(await check_goal(rt, goal_id))
        except (CorruptRecord, ValidationError, ValueError, KeyError, NotFound) as exc:
            # A corrupted (or missing) record cannot be driven: the goal ends, visibly, instead of hanging.
            reason = f"corrupted record: {type(exc).__name__}: {exc}"[:2000]
            log.error("supervisor.corrupted", goal_id=goal_id, error=reason)
            try:
                await rt.store.transition_goal(goal_id, GoalState.FAILED, reason=reason)
            except (IllegalTransition, NotFound, CorruptRecord, ValidationError, ValueError, KeyError):
                await rt.store.drop_inactive(goal_id)
    return n
