"""Critic job handlers: `review` (one task attempt) and `review_goal` (the final answer and its
verdict, written in one call, possibly while the last reviews still run).

docs/internals.md is the contract. Both are safe to run twice: a re-delivered job whose verdict was
already applied only re-enqueues the follow-up job (deterministic ids make that a no-op when it
was enqueued). A goal that has ended gets no model call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Literal

import structlog

import bus.tracing as tracing
from bus.attempts import AttemptStore
from bus.jobs import AdvanceJob, ExecuteJob, ReplanJob, ReviewGoalJob, ReviewJob
from bus.runtime import Runtime
from bus.schemas import (
    Event,
    FinalVerdict,
    GoalRecord,
    GoalState,
    StoredPlan,
    TaskProgress,
    TaskRecord,
    TaskResult,
    TaskSpec,
    TaskState,
    Verdict,
)
from bus.store import IllegalTransition, NotFound, StaleWrite
from bus.synthesis import Progress, Syntheses, accepted_key, speculation_key
from llm.types import ToolUseBlock

from .ask import ask_for_final, ask_for_verdict
from .checks import (
    Action,
    accepted_unreviewed,
    check_problems,
    check_result,
    decide,
    machine_verdict,
    missing_result,
    needs_model_review,
    unusable_verdict,
)
from .prompts import FINAL_SYSTEM, REVIEW_SYSTEM, final_prompt, review_prompt

log = structlog.get_logger("taskloom.critic")

# The final answer gathers every result: give it more room than one verdict.
ANSWER_TOKENS_FACTOR = 2


# -- review of one task attempt ---------------------------------------------------------------


async def review(rt: Runtime, job: ReviewJob) -> None:
    """Judge one attempt: deterministic and machine checks, else the model's verdict (as the goal's
    review policy says); then accept, retry or replan. When this is the last result of the plan to
    reach review, the final answer is started now, beside this review (`_speculate`)."""
    # The goal, the task and the attempt's result in one round trip (the result is used only if
    # the task is in review with this job's attempt).
    try:
        goal, task, result = await rt.store.get_goal_and_task(job.goal_id, job.task_id, result_of=job.attempt)
    except NotFound:
        goal = await rt.store.get_goal(job.goal_id)
        if not goal.terminal:
            raise  # a running goal without this task's record: the job wrapper reports it
    if goal.terminal:
        log.info("review.skipped", state=goal.state.value)
        return
    if task.state is not TaskState.REVIEWING or task.attempt != job.attempt:
        await _redrive(rt, goal, task, job)
        return
    if goal.state is not GoalState.RUNNING:
        # A replan is under way: it supersedes this attempt (only done tasks are kept).
        log.info("review.skipped", state=goal.state.value)
        return
    stored = await rt.store.get_plan(goal.id, goal.plan_version)
    spec = stored.plan.task(task.task_id)
    if spec is None:
        log.info("review.skipped", reason="the task is not in the current plan")
        return
    final = len(stored.plan.tasks) == 1
    # Beside this review, not before it: neither waits for the other's round trips.
    speculation = None if final else asyncio.create_task(_speculate(rt, goal, stored))
    try:
        judged = await _judge(rt, goal, task, spec, result, final)
    finally:
        if speculation is not None:
            await speculation
    if judged is None:
        return  # the budget ran out; the goal was stopped
    verdict, deterministic = judged
    # Attempts of earlier plan versions do not use up this version's retries.
    action = decide(verdict, task.attempt - task.first_attempt + 1, rt.limits)
    _trace_verdict(verdict, action, deterministic)
    event = _verdict_event(
        goal.id,
        task.task_id,
        verdict,
        action,
        attempt=task.attempt,
        deterministic=deterministic,
        review=goal.goal.review,
    )
    await _apply(rt, goal, task, verdict, action, stored, event)
    if action == "accept" and await conclude(rt, goal.id, stored) == "final_missing":
        # Every task is accepted but no final answer was written for these attempts (its speculation
        # was dropped, or the plan has no other review to start it): the planner hands the goal to
        # its final review.
        await rt.jobs.enqueue(AdvanceJob(goal_id=goal.id, task_id=task.task_id, attempt=task.attempt))


async def _speculate(rt: Runtime, goal: GoalRecord, stored: StoredPlan) -> None:
    """Every task of the plan has a result in review or accepted: start the final answer now, for
    exactly these attempts (`bus.synthesis`). Each review job checks after its own task reached
    review, so the last of them always sees them all; they enqueue one job (the id dedupes)."""
    key = speculation_key(stored.plan, await rt.store.get_progress(goal.id, stored.plan.task_ids()))
    if key is not None and await rt.jobs.enqueue(
        ReviewGoalJob(goal_id=goal.id, plan_version=stored.version, attempts=key)
    ):
        log.info("review.speculating", attempts=key)


async def _judge(
    rt: Runtime, goal: GoalRecord, task: TaskRecord, spec: TaskSpec, result: TaskResult | None, final: bool
) -> tuple[Verdict, bool] | None:
    """(verdict, made without a model) or None when the budget refused the model call."""
    if result is None:
        return missing_result(task.attempt), True
    early = check_result(result, spec)
    if early is not None:
        log.info("review.deterministic", stop_reason=result.stop_reason, feedback=early.feedback)
        return early, True
    check = spec.check or (goal.goal.check if final else None)
    if check is not None:
        used = await _tools_used(rt, goal.id, task) if check.tools_called else None
        verdict = machine_verdict(check, result.answer, used)
        log.info("review.machine_check", passed=verdict.passed, feedback=verdict.feedback)
        return verdict, True
    if not needs_model_review(goal.goal.review, final):
        return accepted_unreviewed(goal.goal.review), True
    outcome = await rt.within_budget(
        goal.id,
        ask_for_verdict(
            rt.model_for(goal.id, "critic", goal.goal.model),
            system=REVIEW_SYSTEM,
            prompt=review_prompt(goal.goal, spec, result, task.feedback, final=final),
            max_tokens=rt.limits.model_max_tokens,
            metadata=_meta(goal.id, "review", task.task_id),
        ),
    )
    if outcome is None:
        return None
    if outcome.value is None:
        return unusable_verdict("; ".join(outcome.problems)), False
    return outcome.value, False


async def _tools_used(rt: Runtime, goal_id: str, task: TaskRecord) -> set[str]:
    """The tools the attempt called, from its stored steps (the planner's routed turn included)."""
    steps = await AttemptStore(rt.redis, rt.keys, goal_id, task.task_id, task.attempt).steps()
    return {b.name for step in steps for b in step.assistant.content if isinstance(b, ToolUseBlock)}


async def _apply(
    rt: Runtime,
    goal: GoalRecord,
    task: TaskRecord,
    verdict: Verdict,
    action: Action,
    stored: StoredPlan,
    event: Event,
) -> None:
    """Make the verdict's move, with its `critic.verdict` event in the same script (written only if
    the task moves), and enqueue its follow-up. Nothing moves when the attempt moved on meanwhile."""
    gid, tid, attempt = goal.id, task.task_id, task.attempt
    try:
        if action == "accept":
            moved = await rt.store.transition_task(
                gid, tid, TaskState.DONE, expected_attempt=attempt, expected_state=TaskState.REVIEWING, causes=[event]
            )
            if any(tid in spec.depends_on for spec in stored.plan.tasks):
                # Tasks wait for this one: the planner dispatches those that became ready. (When none
                # does, there is nothing to dispatch; the goal's end is `conclude`'s.)
                await rt.jobs.enqueue(AdvanceJob(goal_id=gid, task_id=tid, attempt=attempt))
        elif action == "retry":
            moved = await rt.store.transition_task(
                gid,
                tid,
                TaskState.RETRYING,
                expected_attempt=attempt,
                expected_state=TaskState.REVIEWING,
                attempt=attempt + 1,
                feedback=verdict.feedback,
                causes=[event],
            )
            await rt.jobs.enqueue(ExecuteJob(goal_id=gid, task_id=tid, attempt=attempt + 1))
        else:
            moved = await rt.store.transition_task(
                gid,
                tid,
                TaskState.FAILED,
                expected_attempt=attempt,
                expected_state=TaskState.REVIEWING,
                reason=_failed_reason(verdict),
                causes=[event],
            )
            await _ask_replan(rt, goal, tid, verdict.feedback)
    except (IllegalTransition, StaleWrite) as exc:
        log.info("review.stale", action=action, error=str(exc))
        return
    log.info("review.applied", action=action, attempt=attempt, moved=moved)


async def _ask_replan(rt: Runtime, goal: GoalRecord, task_id: str, feedback: str) -> None:
    """goal running -> replanning, then the replan job (the version makes its id unique)."""
    await rt.store.transition_goal(goal.id, GoalState.REPLANNING, data={"task_id": task_id, "feedback": feedback})
    reason = f"task {task_id} cannot pass as planned: {feedback}"
    await rt.jobs.enqueue(ReplanJob(goal_id=goal.id, plan_version=goal.plan_version, reason=reason))


async def _redrive(rt: Runtime, goal: GoalRecord, task: TaskRecord, job: ReviewJob) -> None:
    """The verdict on this attempt was applied by an earlier run: re-enqueue its follow-up only."""
    try:
        if task.state is TaskState.DONE and task.attempt == job.attempt:
            await rt.jobs.enqueue(AdvanceJob(goal_id=goal.id, task_id=task.task_id, attempt=job.attempt))
            await conclude(rt, goal.id)
        elif task.state is TaskState.RETRYING and task.attempt == job.attempt + 1:
            await rt.jobs.enqueue(ExecuteJob(goal_id=goal.id, task_id=task.task_id, attempt=task.attempt))
        elif task.state is TaskState.FAILED and task.attempt == job.attempt and goal.state is GoalState.RUNNING:
            await _ask_replan(rt, goal, task.task_id, task.feedback or task.reason or "")
        elif task.state is TaskState.FAILED and task.attempt == job.attempt and goal.state is GoalState.REPLANNING:
            reason = f"task {task.task_id} cannot pass as planned: {task.reason or ''}"
            await rt.jobs.enqueue(ReplanJob(goal_id=goal.id, plan_version=goal.plan_version, reason=reason))
        else:
            log.info("review.skipped", state=task.state.value, task_attempt=task.attempt)
    except IllegalTransition as exc:
        log.info("review.skipped", error=str(exc))


def _failed_reason(verdict: Verdict) -> str:
    return f"rejected by the critic: {verdict.feedback}"


# -- the final answer: synthesis and goal review in one call ----------------------------------


async def review_goal(rt: Runtime, job: ReviewGoalJob) -> None:
    """Write the final answer and its verdict from one set of task attempts (`bus.synthesis`), then
    conclude the goal if every task is accepted with exactly those attempts.

    Started speculatively (goal still running, reviews under way) or once all is accepted (goal
    reviewing): the same job id either way, so one model call. Skipped without a call when the
    attempts are no longer current (a review rejected one): the speculation is dropped."""
    # Read at once: the plan version is the job's (checked against the goal's below). Where this
    # process knows that plan (its reviews read it), only its tasks' progress is read, in one script;
    # else every task record of the goal (its ids first: two round trips).
    syntheses = Syntheses(rt.redis, rt.keys)
    known = rt.store.known_plan(job.goal_id, job.plan_version)
    goal, records, written = await asyncio.gather(
        rt.store.get_goal(job.goal_id),
        rt.store.get_progress(job.goal_id, known.plan.task_ids()) if known is not None else _all_tasks(rt, job.goal_id),
        syntheses.get(job.goal_id, job.plan_version, job.attempts) if job.attempts else _none(),
    )
    if goal.terminal or goal.plan_version != job.plan_version:
        log.info("review_goal.skipped", state=goal.state.value, plan_version=goal.plan_version)
        return
    if goal.state is GoalState.REPLANNING:
        if not job.attempts:
            # Failed by an earlier run that stopped before its enqueue; the job id dedupes.
            reason = _goal_reason(None)
            await rt.jobs.enqueue(ReplanJob(goal_id=goal.id, plan_version=goal.plan_version, reason=reason))
        # A job for given attempts finds a replan asked for by a review: that review enqueues it, with
        # its own reason (the same job id: the first enqueue's reason would stand).
        log.info("review_goal.skipped", state=goal.state.value)
        return
    if goal.state not in (GoalState.RUNNING, GoalState.REVIEWING):
        log.info("review_goal.skipped", state=goal.state.value)
        return
    stored = await rt.store.get_plan(goal.id, goal.plan_version)
    if len(stored.plan.tasks) > 1:
        key = job.attempts or accepted_key(stored.plan, records)
        if not key or speculation_key(stored.plan, records) != key:
            log.info("review_goal.dropped", reason="the attempts it was for are no longer current", attempts=key)
            return
        if not job.attempts:
            written = await syntheses.get(goal.id, stored.version, key)
        if written is None:
            final = await _write_final(rt, goal, stored, records)
            if final is None:
                return  # the budget ran out; the goal was stopped
            # The first write wins: when another run stored its answer first, that one is read.
            written = final if await syntheses.save(goal.id, stored.version, key, final) else None
        # `conclude` need not read again the answer this job wrote or found for these attempts.
        await conclude(rt, goal.id, stored, (stored.version, key, written) if written is not None else None)
        return
    await conclude(rt, goal.id, stored)


async def _none() -> None:
    return None


async def _all_tasks(rt: Runtime, goal_id: str) -> Mapping[str, Progress]:
    return await rt.store.get_tasks(goal_id)


async def _write_final(
    rt: Runtime, goal: GoalRecord, stored: StoredPlan, records: Mapping[str, Progress]
) -> FinalVerdict | None:
    """One model call: the final answer and its verdict; then the goal's machine check, if any."""
    # Each result of the attempts in question, in one read (they are fields of one hash).
    wanted = [(spec.id, records[spec.id].attempt) for spec in stored.plan.tasks]
    found = await rt.store.get_results(goal.id, wanted)
    accepted = [(spec, found[key]) for spec, key in zip(stored.plan.tasks, wanted, strict=True)]
    outcome = await rt.within_budget(
        goal.id,
        ask_for_final(
            rt.model_for(goal.id, "critic", goal.goal.model),
            system=FINAL_SYSTEM,
            prompt=final_prompt(goal.goal, accepted, rt.limits.dependency_result_limit),
            max_tokens=rt.limits.model_max_tokens * ANSWER_TOKENS_FACTOR,
            metadata=_meta(goal.id, "review_goal"),
        ),
    )
    if outcome is None:
        return None
    final = outcome.value
    if final is None:
        why = "; ".join(outcome.problems)
        return FinalVerdict(answer="", passed=False, action="replan", feedback=f"no valid final answer ({why})")
    if final.passed and goal.goal.check is not None:
        problems = check_problems(goal.goal.check, final.answer, None)
        if problems:
            feedback = "Machine check of the final answer failed: " + "; ".join(problems) + "."
            return final.model_copy(update={"passed": False, "action": "replan", "feedback": feedback})
    if not final.passed and goal.goal.review == "none" and final.answer.strip():
        # No model review: the verdict part is not acted on.
        return final.model_copy(update={"passed": True, "action": "accept"})
    return final


Concluded = Literal["concluded", "final_missing", "not_done"]


async def conclude(
    rt: Runtime,
    goal_id: str,
    stored: StoredPlan | None = None,
    written: tuple[int, str, FinalVerdict] | None = None,
) -> Concluded:
    """End the goal if all is in: every task accepted and, for a wider plan, the final answer
    written for exactly the accepted attempts. Succeeds with the answer, or asks for a new plan.
    `stored`: the goal's current plan, when the caller has just read it. `written`: (plan version,
    attempts key, final answer) the caller stored, or found stored (not read again when that version
    is the goal's and those are the accepted attempts). Returns what it found:
    the goal concluded (or had already moved on), every task accepted but no final answer written
    for them yet, or tasks still open.

    Safe to run any number of times, by anyone: the review that accepts the last task and the job
    that stored the final answer both call it (whichever comes second sees both: each writes its
    part before it reads the other's), and only one of them moves the goal."""
    # Only where each task stands (state, attempt) is read, not whole records: every review asks
    # this of every task of the plan.
    records: dict[str, TaskProgress]
    if stored is not None:  # the goal and the plan's tasks in one round trip
        goal, records = await rt.store.get_goal_and_progress(goal_id, stored.plan.task_ids())
    else:
        goal, records = await rt.store.get_goal(goal_id), {}
    if goal.state not in (GoalState.RUNNING, GoalState.REVIEWING):
        return "concluded"
    if stored is None or stored.version != goal.plan_version:
        # A caller's plan from before a replan must not conclude the new one.
        stored = await rt.store.get_plan(goal_id, goal.plan_version)
        records = await rt.store.get_progress(goal_id, stored.plan.task_ids())
    key = accepted_key(stored.plan, records)
    if key is None:
        return "not_done"
    single = len(stored.plan.tasks) == 1
    if single:
        spec = stored.plan.tasks[0]
        result = await rt.store.get_result(goal_id, spec.id, records[spec.id].attempt)
        if result is None:
            return "not_done"
        final = FinalVerdict(answer=result.answer, passed=True, action="accept", feedback="the task's review")
    else:
        if written is not None and written[:2] == (stored.version, key):
            found: FinalVerdict | None = written[2]
        else:
            found = await Syntheses(rt.redis, rt.keys).get(goal_id, stored.version, key)
        if found is None:
            return "final_missing"
        final = found
    await _conclude(rt, goal, stored.version, final, emit=not single)
    return "concluded"


async def _conclude(rt: Runtime, goal: GoalRecord, version: int, final: FinalVerdict, *, emit: bool) -> None:
    # A goal cannot be "retried": any failing verdict means the plan must change. Each move is a
    # checked transition: from a goal that ended or is replanning meanwhile, it raises and nothing moves.
    action: Action = "accept" if final.passed else "replan"
    verdict = Verdict(passed=final.passed, action=action, feedback=final.feedback or "accepted")
    _trace_verdict(verdict, action, False)
    goal_id = goal.id
    # The goal's verdict goes in the same script as the move it causes (a reader that sees the goal
    # succeed has its verdict too); a one-task goal's verdict is its task's, written with that move.
    causes = (
        [_verdict_event(goal_id, None, verdict, action, plan_version=version, review=goal.goal.review)] if emit else []
    )
    try:
        if final.passed:
            # running -> reviewing (or already reviewing: a no-op) -> succeeded
            await rt.store.transition_goal(goal_id, GoalState.REVIEWING)
            moved = await rt.store.transition_goal(goal_id, GoalState.SUCCEEDED, answer=final.answer, causes=causes)
        else:
            moved = await rt.store.transition_goal(
                goal_id, GoalState.REPLANNING, data={"feedback": final.feedback}, causes=causes
            )
            reason = _goal_reason(final.feedback)
            await rt.jobs.enqueue(ReplanJob(goal_id=goal_id, plan_version=version, reason=reason))
    except IllegalTransition as exc:
        log.info("review_goal.stale", error=str(exc))  # cancelled, stopped or concluded meanwhile
        return
    log.info("review_goal.applied", action=action, moved=moved)


def _trace_verdict(verdict: Verdict, action: Action, deterministic: bool) -> None:
    """The verdict and what it leads to, on the review's span (the feedback is model text: content)."""
    tracing.set_attributes(
        taskloom__review__verdict="pass" if verdict.passed else "fail",
        taskloom__review__action=action,
        taskloom__review__deterministic=deterministic,
        taskloom__review__feedback=tracing.content(verdict.feedback) if tracing.settings.content else None,
    )


def _goal_reason(feedback: str | None) -> str:
    return "the final answer did not meet the goal's definition of done" + (f": {feedback}" if feedback else "")


# -- shared helpers ---------------------------------------------------------------------------


def _verdict_event(
    goal_id: str, task_id: str | None, verdict: Verdict, action: Action, **extra: int | bool | str
) -> Event:
    data = {"passed": verdict.passed, "action": action, "feedback": verdict.feedback, **extra}
    return Event(type="critic.verdict", goal_id=goal_id, task_id=task_id, data=data)


def _meta(goal_id: str, purpose: str, task_id: str | None = None) -> dict[str, str]:
    return {"goal_id": goal_id, "role": "critic", "purpose": purpose, **({"task_id": task_id} if task_id else {})}


__all__ = ["conclude", "review", "review_goal"]
