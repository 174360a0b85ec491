"""Planner job handlers: `plan`, `advance`, `replan` (docs/internals.md is the contract).

Each is safe to run twice (arq delivers at least once): it starts from the stored state, skips the
steps that already happened and redoes only idempotent ones (enqueueing a job with a deterministic
id, moving a record to the state it is already in). A goal that has ended gets no model call.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from bus.jobs import AdvanceJob, ExecuteJob, PlanJob, ReplanJob, ReviewGoalJob
from bus.runtime import Runtime
from bus.schemas import GoalRecord, GoalState, Plan, PlanRoute, StoredPlan, TaskRecord, TaskResult, TaskState
from bus.store import IllegalTransition, StaleWrite
from bus.synthesis import accepted_key
from llm.forced import FormOutcome
from llm.toolselect import select_tools
from llm.types import ModelResponse, ToolDef

from .ask import PLAN_TOOL_DEF, Routed, ask_for_plan, ask_routed
from .dag import all_done, ready_tasks, validate_plan
from .prompts import ROUTED_TASK_ID, SYSTEM, plan_prompt, replan_prompt, route_prompt, single_task_plan, usable_tools
from .reconcile import reconcile

log = structlog.get_logger("taskloom.planner")

# A plan is one tool call holding every task: it needs more room than one executor step.
PLAN_TOKENS_FACTOR = 4

ROUTE_REASONS = {
    "tool": "first plan: routed (the model called the goal's tools: one task)",
    "text": "first plan: routed (the model answered directly: one task)",
}


# -- jobs -------------------------------------------------------------------------------------


async def plan(rt: Runtime, job: PlanJob) -> None:
    """Make the first plan (model + validation), store it as version 1, start the goal, dispatch."""
    goal = await rt.store.get_goal(job.goal_id)
    if goal.terminal or goal.state not in (GoalState.SUBMITTED, GoalState.PLANNING):
        await _resume(rt, goal, "plan")
        return
    if goal.state is GoalState.SUBMITTED:
        if not await _move_goal(rt, goal.id, GoalState.PLANNING):
            return
        log.info("plan.claimed")
    else:
        log.info("plan.resumed")  # a run died while planning; its plan may already be stored
    stored = await _first_plan(rt, goal)
    if stored is None or not await _move_goal(rt, goal.id, GoalState.RUNNING):
        return
    await _dispatch_and_review(rt, goal.id, stored)


async def advance(rt: Runtime, job: AdvanceJob) -> None:
    """After an accepted task: dispatch what became ready; when all is done, ask for the goal review."""
    goal = await rt.store.get_goal(job.goal_id)
    await _resume(rt, goal, "advance")


async def replan(rt: Runtime, job: ReplanJob) -> None:
    """Replace plan `job.plan_version` by a new one, keeping accepted work (bounded by `max_replans`)."""
    goal = await rt.store.get_goal(job.goal_id)
    if goal.terminal or goal.state is not GoalState.REPLANNING:
        await _resume(rt, goal, "replan")
        return
    if goal.plan_version == job.plan_version + 1:
        # The new plan was stored by a run that stopped before the goal went back to running.
        old = await rt.store.get_plan(goal.id, job.plan_version)
        await _finish_replan(rt, goal, old.plan, await rt.store.get_plan(goal.id, goal.plan_version))
        return
    if goal.plan_version != job.plan_version:
        log.info("replan.skipped", plan_version=goal.plan_version, job_plan_version=job.plan_version)
        return
    current = await rt.store.get_plan(goal.id, goal.plan_version)
    records = await rt.store.get_tasks(goal.id)
    if goal.replans >= rt.limits.max_replans:
        report = _failure_report(current.plan, records, job.reason)
        await _stop(rt, goal.id, GoalState.FAILED, f"gave up after {goal.replans} replans: {report}")
        return
    stored = await _new_plan(rt, goal, current, records, job.reason)
    if stored is not None:
        await _finish_replan(rt, goal, current.plan, stored)


# -- resuming: what a job finds when its own step already happened -----------------------------


async def _resume(rt: Runtime, goal: GoalRecord, job: str) -> None:
    """Redo the idempotent tail of the goal's current step (dispatch, or the review_goal enqueue)."""
    if goal.state is GoalState.RUNNING:
        await _dispatch_and_review(rt, goal.id, await rt.store.get_plan(goal.id, goal.plan_version))
    elif goal.state is GoalState.REVIEWING:
        await _enqueue_final(rt, goal.id, await rt.store.get_plan(goal.id, goal.plan_version))
    else:
        # Ended (no model call, nothing to do), or a replan is under way and will dispatch itself.
        log.info(f"{job}.skipped", state=goal.state.value)


# -- planning ---------------------------------------------------------------------------------


def _offered(rt: Runtime, goal: GoalRecord, catalog: list[ToolDef], also: str = "") -> list[ToolDef]:
    """The tools the planner's prompt lists: the goal's allowed ones, narrowed by its own words when
    the catalog is large (`llm.toolselect`; tools named in `also` are kept). A plan may still name
    any tool of the catalog."""
    text = f"{goal.goal.text}\n{goal.goal.definition_of_done}\n{also}"
    return select_tools(usable_tools(catalog, goal.goal.allowed_tools), text, rt.limits.tool_select_limit)


def _validator(rt: Runtime, goal: GoalRecord, catalog: list[ToolDef]) -> Callable[[Plan], list[str]]:
    # Any tool of the catalog is accepted in a plan, also one the prompt did not list.
    known = [t.name for t in catalog]
    allowed = set(goal.goal.allowed_tools) if goal.goal.allowed_tools is not None else None

    def validate(p: Plan) -> list[str]:
        return validate_plan(p, known_tools=known, allowed_tools=allowed, max_tasks=rt.limits.max_plan_tasks)

    return validate


async def _ask(rt: Runtime, goal: GoalRecord, prompt: str, purpose: str) -> FormOutcome[Plan] | None:
    validate = _validator(rt, goal, await rt.tool_definitions())
    return await rt.within_budget(
        goal.id,
        ask_for_plan(
            rt.model_for(goal.id, "planner", goal.goal.model),
            system=SYSTEM,
            prompt=prompt,
            validate=validate,
            attempts=rt.limits.max_plan_attempts,
            max_tokens=rt.limits.model_max_tokens * PLAN_TOKENS_FACTOR,
            metadata={"goal_id": goal.id, "role": "planner", "purpose": purpose},
        ),
    )


async def _first_plan(rt: Runtime, goal: GoalRecord) -> StoredPlan | None:
    if goal.plan_version >= 1:
        # Stored by a run that stopped before the goal went to running: use it, do not ask again.
        return await rt.store.get_plan(goal.id, goal.plan_version)
    catalog = await rt.tool_definitions()
    unknown = sorted(set(goal.goal.allowed_tools or ()) - {t.name for t in catalog})
    if unknown:
        # A goal that names a tool no worker has cannot be done as asked: say so instead of letting a
        # plan without it produce a junk answer. No model call is made.
        known = ", ".join(t.name for t in catalog) or "none"
        reason = f"allowed_tools: unknown tool {', '.join(unknown)} (loaded: {known})"
        await _stop(rt, goal.id, GoalState.FAILED, reason)
        return None
    tools = _offered(rt, goal, catalog)
    if any(t.name == PLAN_TOOL_DEF.name for t in tools):
        # A loaded tool shadows submit_plan: the model could not tell them apart, so plan forced.
        outcome = await _ask(rt, goal, plan_prompt(goal.goal, tools, rt.limits.max_plan_tasks), "plan")
    else:
        routed = await _route(rt, goal, tools, catalog)
        if routed is None:
            return None
        if routed.turn is not None:
            plan = single_task_plan(goal.goal, [t.name for t in tools] if routed.route == "tool" else [])
            why = ROUTE_REASONS[routed.route]
            return await _store(
                rt, goal.id, plan, expected_version=0, reason=why, route=routed.route, first_turn=routed.turn
            )
        outcome = routed.outcome
    if outcome is None:
        return None
    if outcome.value is None:
        await _stop(rt, goal.id, GoalState.FAILED, _no_plan_reason(outcome))
        return None
    return await _store(rt, goal.id, outcome.value, expected_version=0, reason="first plan")


async def _route(rt: Runtime, goal: GoalRecord, tools: list[ToolDef], catalog: list[ToolDef]) -> Routed | None:
    """The first planning call, route first: the goal's tools and submit_plan are offered together."""
    # A goal answered in text is answered by this very call: its words stream as the routed task's
    # first step (the task it becomes, attempt 1, step 0), so a watcher sees the answer being written.
    sink = await rt.live.sink(goal.id, ROUTED_TASK_ID, 1, 0) if rt.live is not None else None
    try:
        return await rt.within_budget(
            goal.id,
            ask_routed(
                rt.model_for(goal.id, "planner", goal.goal.model),
                system=SYSTEM,
                prompt=route_prompt(goal.goal, rt.limits.max_plan_tasks),
                tools=tools,
                validate=_validator(rt, goal, catalog),
                attempts=rt.limits.max_plan_attempts,
                max_tokens=rt.limits.model_max_tokens * PLAN_TOKENS_FACTOR,
                metadata={"goal_id": goal.id, "role": "planner", "purpose": "plan"},
                on_text=sink,
            ),
        )
    finally:
        if sink is not None:
            await sink.close()


async def _new_plan(
    rt: Runtime, goal: GoalRecord, current: StoredPlan, records: dict[str, TaskRecord], reason: str
) -> StoredPlan | None:
    results = await _accepted_results(rt, goal.id, current.plan, records)
    used = " ".join(tool for spec in current.plan.tasks for tool in spec.tools)  # the current plan's tools
    tools = _offered(rt, goal, await rt.tool_definitions(), also=f"{reason}\n{used}")
    prompt = replan_prompt(
        goal.goal,
        tools,
        rt.limits.max_plan_tasks,
        current=current.plan,
        version=current.version,
        records=records,
        results=results,
        reason=reason,
        result_limit=rt.limits.dependency_result_limit,
    )
    outcome = await _ask(rt, goal, prompt, "replan")
    if outcome is None:
        return None
    if outcome.value is None:
        await _stop(rt, goal.id, GoalState.FAILED, _no_plan_reason(outcome))
        return None
    why = f"replan of version {current.version}" + (f": {reason}" if reason else "")
    return await _store(rt, goal.id, outcome.value, expected_version=current.version, reason=why)


async def _store(
    rt: Runtime,
    goal_id: str,
    new: Plan,
    *,
    expected_version: int,
    reason: str,
    route: PlanRoute = "plan",
    first_turn: ModelResponse | None = None,
) -> StoredPlan | None:
    """Save the plan; if another run saved this version first, continue with the one it stored."""
    if (await rt.store.get_goal(goal_id)).terminal:
        log.info("plan.discarded", reason="the goal ended while the plan was being made")
        return None
    try:
        version = await rt.store.save_plan(
            goal_id, new, expected_version=expected_version, reason=reason, route=route, first_turn=first_turn
        )
    except StaleWrite:
        log.info("plan.already_stored", expected_version=expected_version)
        return await rt.store.get_plan(goal_id, expected_version + 1)
    log.info("plan.stored", version=version, tasks=[t.id for t in new.tasks])
    # What was just written, without reading it back.
    return StoredPlan(goal_id=goal_id, version=version, plan=new, reason=reason, route=route, first_turn=first_turn)


async def _finish_replan(rt: Runtime, goal: GoalRecord, old: Plan, new: StoredPlan) -> None:
    records = await rt.store.get_tasks(goal.id)
    moves = reconcile(old, new.plan, records, new.version)
    for tid in moves.supersede:
        await _move_task(rt, goal.id, tid, TaskState.SUPERSEDED, reason=f"dropped or changed by plan v{new.version}")
    for tid in moves.restore:
        # Feedback and reason belonged to the old spec; the returning task starts clean.
        await _move_task(rt, goal.id, tid, TaskState.PENDING, plan_version=new.version, reason="", feedback="")
    log.info("plan.replanned", version=new.version, kept=moves.keep, superseded=moves.supersede, restored=moves.restore)
    if await _move_goal(rt, goal.id, GoalState.RUNNING, fields={"replans": goal.replans + 1}):
        await _dispatch_and_review(rt, goal.id, new)


# -- dispatch ---------------------------------------------------------------------------------


async def _dispatch_and_review(rt: Runtime, goal_id: str, stored: StoredPlan) -> None:
    """Dispatch every ready task; when every task of the plan is done, hand the goal to review."""
    records = await rt.store.get_tasks(goal_id, stored.plan.task_ids())
    states = {tid: rec.state for tid, rec in records.items()}
    claimable = [records[tid] for tid in ready_tasks(stored.plan, states) if tid in records]
    # Claimed by a run that stopped before its enqueue: enqueued again (the job id dedupes).
    unqueued = [rec for rec in records.values() if rec.state is TaskState.READY and stored.plan.task(rec.task_id)]
    await _dispatch(rt, goal_id, claimable, unqueued)
    if all_done(stored.plan, states) and await _move_goal(rt, goal_id, GoalState.REVIEWING):
        await _enqueue_final(rt, goal_id, stored, records)
        log.info("plan.all_done", version=stored.version)


async def _enqueue_final(
    rt: Runtime, goal_id: str, stored: StoredPlan, records: dict[str, TaskRecord] | None = None
) -> None:
    """The final answer's job, for the accepted attempts. A speculative job the critic started for
    the same attempts has the same id (no second call); once it has run, the critic concludes."""
    records = records if records is not None else await rt.store.get_tasks(goal_id, stored.plan.task_ids())
    key = accepted_key(stored.plan, records) or ""
    await rt.jobs.enqueue(ReviewGoalJob(goal_id=goal_id, plan_version=stored.version, attempts=key))


async def _dispatch(rt: Runtime, goal_id: str, pending: list[TaskRecord], ready: list[TaskRecord]) -> None:
    """Claim each `pending` task (pending -> ready, the atomic claim, with the next attempt), then
    enqueue the execute job of every task claimed here and of every `ready` one (claimed by a run
    that stopped before its enqueue; the deterministic job id dedupes).

    The claims go out in one round trip and the enqueues in another, each still its own atomic
    script: every ready task at once, and the last one is on the goal's critical path. Attempts keep
    counting across plan versions: a task a replan brings back must not reuse an attempt number,
    whose job id and stored result already exist.
    """
    # pending -> ready starts the task under its current plan version: retries count from here.
    moves = [
        rt.store.task_move(
            goal_id, rec.task_id, TaskState.READY, attempt=rec.attempt + 1, first_attempt=rec.attempt + 1
        )
        for rec in pending
    ]
    jobs = [ExecuteJob(goal_id=goal_id, task_id=rec.task_id, attempt=rec.attempt) for rec in ready]
    claimed: dict[str, bool] = {}
    failure: BaseException | None = None
    for rec, outcome in zip(pending, await rt.store.transition_tasks(moves), strict=True):
        attempt = rec.attempt + 1
        if isinstance(outcome, IllegalTransition):
            log.info("task.dispatch_skipped", task_id=rec.task_id, state=outcome.current)  # moved on meanwhile
            continue
        if isinstance(outcome, BaseException):
            failure = failure or outcome  # the others still go out; this job's re-run redoes it
            continue
        if not outcome:
            # Already ready: claimed concurrently, or by a crashed run; enqueue its attempt anyway.
            now = await rt.store.get_task(goal_id, rec.task_id)
            if now.state is not TaskState.READY:
                continue
            attempt = now.attempt
        claimed[rec.task_id] = outcome
        jobs.append(ExecuteJob(goal_id=goal_id, task_id=rec.task_id, attempt=attempt))
    await rt.jobs.enqueue_many(jobs)
    for job in jobs:
        if job.task_id in claimed:
            log.info("task.dispatched", task_id=job.task_id, attempt=job.attempt, claimed=claimed[job.task_id])
    if failure is not None:
        raise failure


# -- small I/O helpers ------------------------------------------------------------------------


async def _accepted_results(
    rt: Runtime, goal_id: str, current: Plan, records: dict[str, TaskRecord]
) -> dict[str, TaskResult]:
    results = await rt.store.latest_results(goal_id, [t.id for t in current.tasks], records, done_only=True)
    return {tid: result for tid, result in results.items() if result is not None}


async def _move_goal(
    rt: Runtime,
    goal_id: str,
    target: GoalState,
    *,
    reason: str | None = None,
    fields: dict[str, str | int] | None = None,
) -> bool:
    """True when the goal is now in `target` (moved, or already there); False if it went elsewhere."""
    try:
        await rt.store.transition_goal(goal_id, target, reason=reason, fields=fields)
    except IllegalTransition as exc:
        log.info("goal.moved_on", target=target.value, state=exc.current)
        return False
    return True


async def _move_task(
    rt: Runtime,
    goal_id: str,
    task_id: str,
    target: TaskState,
    *,
    reason: str | None = None,
    feedback: str | None = None,
    plan_version: int | None = None,
) -> None:
    try:
        await rt.store.transition_task(
            goal_id, task_id, target, reason=reason, feedback=feedback, plan_version=plan_version
        )
    except IllegalTransition as exc:
        log.info("task.moved_on", task_id=task_id, target=target.value, state=exc.current)


async def _stop(rt: Runtime, goal_id: str, target: GoalState, reason: str) -> None:
    log.warning("plan.goal_stopped", state=target.value, reason=reason)
    await _move_goal(rt, goal_id, target, reason=reason)


def _no_plan_reason(outcome: FormOutcome[Plan]) -> str:
    listed = " ".join(outcome.problems)
    return f"no valid plan after {outcome.attempts} attempts: {listed}"


def _failure_report(current: Plan, records: dict[str, TaskRecord], reason: str) -> str:
    lines = []
    for spec in current.tasks:
        rec = records.get(spec.id)
        why = rec and rec.state is not TaskState.DONE and (rec.reason or rec.feedback)
        if rec is not None and why:
            lines.append(f"task {spec.id} {rec.state.value}: {why}")
    return "; ".join([*([reason] if reason else []), *lines]) or "no details"


__all__ = ["advance", "plan", "replan"]
