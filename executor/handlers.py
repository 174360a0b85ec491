"""The executor's job handler: claim the attempt, run (or resume) its loop, store the result, hand
it to the critic. Safe to run twice: a copy that finds the attempt finished, moved on, or leased by
a live executor does nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable

import structlog

from bus.approvals import ApprovalBook
from bus.attempts import AttemptStore, LeaseLost, Pending, claim_expired, drop_lease, now_ms
from bus.batch import run_scripts_and_reads
from bus.effects import SideEffects
from bus.jobs import ExecuteJob, ReviewJob
from bus.observe import observe
from bus.renewals import AttemptLease, Renewal, Renewals, TenantSlot
from bus.runtime import Runtime
from bus.schemas import GOAL_TERMINAL, GoalRecord, TaskRecord, TaskResult, TaskState
from bus.stops import TaskStop
from bus.store import IllegalTransition, NotFound, StaleWrite
from bus.tenants import Tenants
from llm.toolselect import select_tools
from llm.types import ModelResponse

from .gateway import ToolGateway
from .loop import Handover, Loop, Paused, TaskInput
from .pipeline import Attempt, History, RedisApprovals
from .registry import ToolRegistry
from .sources.catalog import ToolCatalog

log = structlog.get_logger("taskloom.executor")

STARTABLE = {TaskState.READY, TaskState.RETRYING, TaskState.WAITING_APPROVAL}
HOLDER = f"{socket.gethostname()}:{os.getpid()}"


async def _task_input(
    rt: Runtime, job: ExecuteJob, goal: GoalRecord, plan_version: int, feedback: str | None
) -> tuple[TaskInput, ModelResponse | None]:
    """The attempt's input, and the planner's routed turn when this is the first attempt of a
    routed plan's task (its first step, already received and billed: see `_seed_routed_turn`).
    `goal` as `execute` read it a moment ago (its text, budget and deadline never change)."""
    stored = await rt.store.get_plan(job.goal_id, plan_version)
    plan = stored.plan
    spec = plan.task(job.task_id)
    if spec is None:
        raise NotFound("task spec", f"{job.goal_id}/{job.task_id} in plan v{plan_version}")
    results = await rt.store.latest_results(job.goal_id, spec.depends_on) if spec.depends_on else {}
    deps = [(dep, result.answer if result else "(no result)") for dep, result in results.items()]
    # Side effects of earlier attempts (attempt numbers start at 1: the first has none to read).
    effects = await SideEffects(rt.redis, rt.keys).history(job.goal_id, job.task_id) if job.attempt > 1 else []
    earlier = [e for e in effects if e.attempt < job.attempt]
    task = TaskInput(
        goal=goal,
        spec=spec,
        attempt=job.attempt,
        feedback=feedback,
        dependency_results=tuple(deps),
        earlier_effects=tuple(earlier),
    )
    return task, stored.first_turn if job.attempt == 1 and len(plan.tasks) == 1 else None


async def _seed_routed_turn(store: AttemptStore, turn: ModelResponse) -> None:
    """Make the planner's routed turn the attempt's pending turn, unless the attempt already has a
    step or a pending turn (a re-run): the loop then applies it (its tool calls run here, through
    the gateway, with approvals, idempotency keys and side-effect records as for any turn) and
    continues, without asking the model for it again."""
    if await store.pending() != Pending() or await store.steps():
        return
    await store.save_turn(turn)
    log.info("execute.routed_turn", tools=[u.name for u in turn.tool_uses])


def _offered(registry: ToolRegistry, task: TaskInput, goal_tools: list[str] | None, limit: int) -> list[str]:
    """The tools a task may use (those its spec names that the goal allows); when the planner gave
    it more than `limit`, the ones its own words are about (`llm.toolselect`)."""
    allowed = ToolGateway.allowed_for(goal_tools, task.spec.tools)
    spec = task.spec
    text = f"{spec.title}\n{spec.instructions}\n{spec.definition_of_done}"
    return [t.name for t in select_tools(registry.definitions(allowed), text, limit)]


async def execute(rt: Runtime, job: ExecuteJob, tools: ToolCatalog, stopping: Callable[[], bool] | None = None) -> None:
    """Run or resume one task attempt with the tools of `tools` (a `ToolRegistry`, or the worker's
    live `Catalog`). `stopping()` turns true when this worker shuts down: the loop then hands the
    attempt over between two steps (see `_hand_over`).

    The attempt holds one of its tenant's running slots (`bus.tenants`, `max_running`) while it
    runs; when none is free, `TenantBusy` escapes and the job layer runs this job again shortly."""
    try:
        goal, task, _ = await rt.store.get_goal_and_task(job.goal_id, job.task_id)
    except NotFound:
        goal = await rt.store.get_goal(job.goal_id)
        if goal.state not in GOAL_TERMINAL:
            raise  # a live goal without this task's record: the job wrapper reports it
    if goal.state in GOAL_TERMINAL:
        log.info("execute.skipped", reason=f"goal {goal.state.value}")
        return
    tenants = Tenants(rt.redis, rt.keys)
    tenant, member = goal.goal.tenant, f"{job.goal_id}/{job.task_id}"
    # The slot expires unless renewed, so a dead executor frees it within two lease periods.
    await tenants.acquire_slot(tenant, member, 2 * rt.limits.lease_ttl)
    slot = _Slot(rt, tenants, tenant, member)
    try:
        await _execute(rt, job, goal, task, tools, stopping, slot)
    finally:
        await slot.release()


class _Slot:
    """The tenant running slot an attempt holds: renewed while it runs, released when it ends, in
    the attempt's last round trip when it has one (`_finish`: `stop_renewing`, then
    `release_command` in that round trip, then `released`), else on its own (`release`)."""

    def __init__(self, rt: Runtime, tenants: Tenants, tenant: str, member: str) -> None:
        self.tenants, self.tenant, self.member = tenants, tenant, member
        self.released = False
        held = TenantSlot(tenants, tenant, member, rt.limits.lease_ttl)
        self._renew = asyncio.create_task(_keep(rt.renewer(), held))

    async def stop_renewing(self) -> None:
        self._renew.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._renew  # a renewal in flight lands first: it must not re-take the released slot

    def release_command(self) -> tuple[str, str, str]:
        return ("ZREM", self.tenants.keys.tenant_running(self.tenant), self.member)

    async def release(self) -> None:
        await self.stop_renewing()
        if not self.released:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.tenants.release_slot(self.tenant, self.member))


async def _keep(renewals: Renewals, item: Renewal) -> None:
    """Keep `item` renewed (in the process's batched renewals, bus.renewals) until cancelled."""
    async with renewals.hold(item):
        await asyncio.Event().wait()


async def _execute(
    rt: Runtime,
    job: ExecuteJob,
    goal: GoalRecord,
    read: TaskRecord,
    tools: ToolCatalog,
    stopping: Callable[[], bool] | None,
    slot: _Slot | None = None,
) -> None:
    """`goal` and the task (`read`): as `execute` read them together, just before taking the tenant
    slot (`slot`; the goal was not terminal then)."""
    # The process's held settles ride on the attempt's writes (bus.ledger).
    store = AttemptStore(rt.redis, rt.keys, job.goal_id, job.task_id, job.attempt, rt.events.maxlen, rt.ledger)
    holder = f"{HOLDER}:{uuid.uuid4().hex[:8]}"
    task = await _start(rt, job, read, store, holder)
    if task is None:
        return
    stored = rt.store.parse_result(job.goal_id, job.task_id, job.attempt, store.stored_result)
    if stored is not None:
        # An earlier run stored the result and died before handing it on: finish that, run nothing.
        log.info("execute.finishing_stored_result", stop_reason=stored.stop_reason)
        await _finish(rt, store, stored)
        return
    heartbeat = asyncio.create_task(_keep(rt.renewer(), AttemptLease(store, rt.limits.lease_ttl)))
    clock, outcome = time.perf_counter(), "failed"  # for metrics: how this run of the loop ended
    try:
        loop = await _make_loop(rt, job, goal, task, tools, store, stopping)
        outcome = await _run_loop(rt, job, loop, store, heartbeat, slot)
    except LeaseLost as exc:
        outcome = "lease_lost"
        log.warning("execute.lease_lost", detail=str(exc))
    except Exception:
        # A model error (or any other failure) escapes to the job layer, which re-runs this same job
        # later or fails the goal (bus.retry). Free the lease now so the re-run resumes the attempt
        # at its current step at once; the watchdogs leave it alone until the re-run is due.
        outcome = "retry"
        with contextlib.suppress(Exception):
            await _give_up(store, heartbeat, rt.retry.cap + rt.limits.lease_ttl)
        raise
    except asyncio.CancelledError:
        outcome = "interrupted"
        if stopping is not None and stopping():
            # The shutdown grace ran out in the middle of a step. Give the lease up now, so that
            # arq's re-run of this job (or a watchdog) resumes the attempt on another executor at
            # once instead of after the lease TTL. The step resumes from what it stored; a started
            # side-effecting call without a result is reported as an unknown outcome, never re-run.
            with contextlib.suppress(Exception):
                await asyncio.shield(_give_up(store, heartbeat))
            log.warning("execute.interrupted", detail="shutdown grace over; lease released for another executor")
        raise
    finally:
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError, LeaseLost):
            await heartbeat
        seconds = time.perf_counter() - clock
        observe(lambda o: o.task_run(outcome, seconds))


async def _start(
    rt: Runtime, job: ExecuteJob, task: TaskRecord, store: AttemptStore, holder: str
) -> TaskRecord | None:
    """Move the job's task (`task`, as just read) to `running` if this job may run it, and take the
    attempt's lease (`store`, for `holder`); None (logged) when it may not run it, or another
    executor holds the lease.

    The goal and the task were read together by `execute`, one round trip earlier, not again here:
    a goal or task that moves after that read is the same race as one that moves just after any
    read (the move to running is checked in its script). The move and the lease go out in one
    round trip, the move first; a refused move gives back the lease it came with (the attempt is
    not this job's to run, nobody needs to resume it)."""
    if task.attempt != job.attempt:
        log.info("execute.skipped", reason=f"task is on attempt {task.attempt}")
        return None
    if task.state in STARTABLE:
        move = rt.store.task_move(job.goal_id, job.task_id, TaskState.RUNNING, expected_attempt=job.attempt)
        # The attempt's plan (read next, by `_task_input`) comes in the same round trip.
        read = rt.store.plan_read(job.goal_id, task.plan_version)
        (moved, leased), plan = await run_scripts_and_reads(
            rt.redis, [move.call, store.acquire_call(holder, rt.limits.lease_ttl)], [read] if read else []
        )
        if plan:
            rt.store.remember_plan(job.goal_id, task.plan_version, plan[0])
        try:
            rt.store.move_outcome(move, moved)
        except (IllegalTransition, StaleWrite) as exc:
            if store.acquired(leased):
                await store.finish()
            log.info("execute.skipped", reason=str(exc))
            return None
        if not store.acquired(leased):
            log.info("execute.skipped", reason="another executor holds the attempt's lease")
            return None
        return task
    if task.state == TaskState.REVIEWING:
        # An earlier run died between moving the task to review and enqueueing the review: send it
        # again (the job id is deterministic, so a review already queued or done is not repeated).
        await rt.jobs.enqueue(ReviewJob(goal_id=job.goal_id, task_id=job.task_id, attempt=job.attempt))
        log.info("execute.skipped", reason="already in review; review job re-sent")
        return None
    if task.state != TaskState.RUNNING:
        log.info("execute.skipped", reason=f"task is {task.state.value}")
        return None
    if not await store.acquire(holder, rt.limits.lease_ttl):
        log.info("execute.skipped", reason="another executor holds the attempt's lease")
        return None
    return task


async def _make_loop(
    rt: Runtime,
    job: ExecuteJob,
    goal: GoalRecord,
    task: TaskRecord,
    tools: ToolCatalog,
    store: AttemptStore,
    stopping: Callable[[], bool] | None,
) -> Loop:
    """The attempt's loop: its input, the tools it is offered, and the services it writes through."""
    task_input, routed = await _task_input(rt, job, goal, task.plan_version, task.feedback)
    if routed is not None:
        await _seed_routed_turn(store, routed)
    registry = await tools.snapshot()
    allowed = _offered(registry, task_input, goal.goal.allowed_tools, rt.limits.tool_select_limit)
    attempt = Attempt(
        goal_id=job.goal_id,
        task_id=job.task_id,
        attempt=job.attempt,
        store=store,
        history=History(),
        approvals=RedisApprovals(ApprovalBook(rt.redis, rt.keys, rt.events.maxlen), job.goal_id),
        effects=SideEffects(rt.redis, rt.keys),
    )
    gateway = ToolGateway(
        registry,
        allowed,
        rt.events,
        output_limit=rt.limits.tool_output_limit,
        default_timeout=rt.limits.tool_timeout,
        attempt=attempt,
        loop_window=rt.limits.loop_window,
        error_retries=rt.limits.tool_error_retries,
    )

    first = [True]

    async def is_cancelled() -> bool:
        if first[0]:
            # Asked before the first model call, a moment after `_start` read the task and this job
            # moved it to running: that read answers (a cancel in between is seen at the next check).
            first[0] = False
            return False
        # Before a later call: the previous step's write read the task's state in its script, an
        # instant ago (same rule: a cancel after that read is seen at the next check).
        seen = store.task_seen()
        if seen is None:
            current = await rt.store.get_task(job.goal_id, job.task_id)
            seen = current.state.value, current.attempt
        return seen[0] in (TaskState.CANCELLED.value, TaskState.SUPERSEDED.value) or seen[1] != job.attempt

    return Loop(
        task_input,
        store,
        # Its settles ride on the attempt's next write (one ledger round trip per call); `_run_loop`
        # flushes what is left.
        rt.model_for(job.goal_id, "executor", goal.goal.model, hold_settles=True),
        gateway,
        rt.limits,
        is_cancelled,
        stopping,
        live=rt.live,
    )


async def _run_loop(
    rt: Runtime,
    job: ExecuteJob,
    loop: Loop,
    store: AttemptStore,
    heartbeat: asyncio.Task[None],
    slot: _Slot | None = None,
) -> str:
    """Run the loop under the lease and act on how it ended; returns that outcome (for metrics)."""
    try:
        try:
            result = await loop.run()
        finally:
            # The books are exact before the attempt's result, pause or hand-over is stored. Should
            # Redis be out of reach, the settles stay held and go out within the settle delay.
            await rt.flush_settles()
    except Handover as handover:
        await _hand_over(rt, store, job, heartbeat, handover.steps)
        return "handover"
    except Paused as paused:
        await rt.store.transition_task(
            job.goal_id,
            job.task_id,
            TaskState.WAITING_APPROVAL,
            expected_attempt=job.attempt,
            data={"call_id": paused.call.id, "tool": paused.call.name},
        )
        await store.finish()  # nobody should resume it before the decision
        log.info("execute.paused", call_id=paused.call.id, tool=paused.call.name)
        return "paused"
    await _finish(rt, store, result, slot)
    return result.stop_reason.value


async def _give_up(store: AttemptStore, heartbeat: asyncio.Task[None], watchdog_after: float = 0.0) -> bool:
    """Release the attempt's lease, renewals stopped first (a late renewal would re-take it)."""
    heartbeat.cancel()
    with contextlib.suppress(asyncio.CancelledError, LeaseLost):
        await heartbeat
    return await store.release(watchdog_after)


async def _hand_over(
    rt: Runtime, store: AttemptStore, job: ExecuteJob, heartbeat: asyncio.Task[None], steps: int
) -> None:
    """This worker is shutting down between two steps: every completed step is stored. Release the
    lease, then enqueue a resume job that another executor picks up at once (this worker takes no
    more jobs). Released before enqueueing, so the resume can never find the lease still held; if
    the enqueue fails, the released lease is already expired and a watchdog resumes the attempt."""
    if not await _give_up(store, heartbeat):
        log.info("execute.handover_skipped", reason="the lease was no longer ours")
        return
    resume = ExecuteJob(goal_id=job.goal_id, task_id=job.task_id, attempt=job.attempt, resume=now_ms())
    await rt.jobs.enqueue(resume)
    log.info("execute.handover", steps=steps, resume=resume.resume)


async def _finish(rt: Runtime, store: AttemptStore, result: TaskResult, slot: _Slot | None = None) -> None:
    """Store the result (under the lease) and move the task on according to how it stopped; a
    task put in review gives its tenant `slot` back in the same round trip."""
    await store.save_result(result)
    gid, tid, attempt = result.goal_id, result.task_id, result.attempt
    log.info("execute.result", stop_reason=result.stop_reason, steps=result.steps, tool_calls=result.tool_calls)
    if result.stop_reason == TaskStop.CANCELLED:
        await store.finish()
        return
    if result.stop_reason == TaskStop.BUDGET_EXHAUSTED:
        with contextlib.suppress(IllegalTransition, StaleWrite):
            await rt.store.transition_task(
                gid, tid, TaskState.FAILED, expected_attempt=attempt, reason="budget_exhausted"
            )
        await rt.budget_exhausted(gid, f"budget exhausted in task {tid}")
        await store.finish()
        return
    # The move to review, the review's enqueue and the lease's end in one round trip, run in that
    # order, each atomic on its own. A refused move (the task was cancelled or superseded meanwhile)
    # still sends the review, which finds the task so and skips it: that rare wasted job is cheaper
    # than a round trip on every task. Should the enqueue fail, this job's re-run finds the task in
    # review and enqueues it again (`_start`).
    move = rt.store.task_move(
        gid, tid, TaskState.REVIEWING, expected_attempt=attempt, data={"stop_reason": result.stop_reason}
    )
    review = ReviewJob(goal_id=gid, task_id=tid, attempt=attempt)
    extra = []
    if slot is not None:
        await slot.stop_renewing()
        extra.append(slot.release_command())
    _, moved = await rt.jobs.enqueue_with(review, store.finish_call(), before=move.call, extra=extra)
    if slot is not None:
        slot.released = True
    try:
        rt.store.move_outcome(move, moved)
    except IllegalTransition as exc:
        log.info("execute.not_reviewed", reason=str(exc))


async def recover_expired(rt: Runtime, limit: int = 100) -> int:
    """Re-enqueue attempts whose executor died (lease expired). Run periodically by every executor.

    Each expired lease is claimed by one watchdog for one lease period; the resumed job resumes
    from the stored steps. Attempts that ended meanwhile are dropped from the lease set.
    """
    n = 0
    for goal_id, task_id, attempt in await claim_expired(rt.redis, rt.keys, limit, rt.limits.lease_ttl):
        try:
            task = await rt.store.get_task(goal_id, task_id)
        except NotFound:
            task = None
        ended = task is not None and (await rt.store.get_goal(goal_id)).terminal
        if task is None or ended or task.attempt != attempt or task.state != TaskState.RUNNING:
            await drop_lease(rt.redis, rt.keys, goal_id, task_id, attempt)
            continue
        await rt.jobs.enqueue(ExecuteJob(goal_id=goal_id, task_id=task_id, attempt=attempt, resume=now_ms()))
        log.warning("execute.recovered", goal_id=goal_id, task_id=task_id, attempt=attempt)
        n += 1
    return n
