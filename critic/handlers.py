"""Critic job handlers: `review` (one task attempt) and `review_goal` (the final answer).

docs/internals.md is the contract. Both are safe to run twice: a re-delivered job whose verdict was
already applied only re-enqueues the follow-up job (deterministic ids make that a no-op when it
was enqueued). A goal that has ended gets no model call.
"""

from __future__ import annotations

import structlog

from bus.jobs import AdvanceJob, ExecuteJob, ReplanJob, ReviewGoalJob, ReviewJob
from bus.runtime import Runtime
from bus.schemas import Event, GoalRecord, GoalState, TaskRecord, TaskResult, TaskSpec, TaskState, Verdict
from bus.store import IllegalTransition, StaleWrite

from .ask import ask_for_verdict, write_answer
from .checks import Action, check_result, decide, missing_result, unusable_verdict
from .prompts import ANSWER_SYSTEM, GOAL_REVIEW_SYSTEM, REVIEW_SYSTEM, answer_prompt, goal_review_prompt, review_prompt

log = structlog.get_logger("taskloom.critic")

# The final answer gathers every result: give it more room than one verdict.
ANSWER_TOKENS_FACTOR = 2


# -- review of one task attempt ---------------------------------------------------------------


async def review(rt: Runtime, job: ReviewJob) -> None:
    """Judge one attempt: deterministic checks, else the model's verdict; then accept, retry or replan."""
    goal = await rt.store.get_goal(job.goal_id)
    if goal.terminal:
        log.info("review.skipped", state=goal.state.value)
        return
    task = await rt.store.get_task(job.goal_id, job.task_id)
    if task.state is not TaskState.REVIEWING or task.attempt != job.attempt:
        await _redrive(rt, goal, task, job)
        return
    if goal.state is not GoalState.RUNNING:
        # A replan is under way: it supersedes this attempt (only done tasks are kept).
        log.info("review.skipped", state=goal.state.value)
        return
    spec = (await rt.store.get_plan(goal.id, goal.plan_version)).plan.task(task.task_id)
    if spec is None:
        log.info("review.skipped", reason="the task is not in the current plan")
        return
    result = await rt.store.get_result(goal.id, task.task_id, task.attempt)
    judged = await _judge(rt, goal, task, spec, result)
    if judged is None:
        return  # the budget ran out; the goal was stopped
    verdict, deterministic = judged
    # Attempts of earlier plan versions do not use up this version's retries.
    action = decide(verdict, task.attempt - task.first_attempt + 1, rt.limits)
    if await _apply(rt, goal, task, verdict, action):
        await _emit(rt, goal.id, task.task_id, verdict, action, attempt=task.attempt, deterministic=deterministic)


async def _judge(
    rt: Runtime, goal: GoalRecord, task: TaskRecord, spec: TaskSpec, result: TaskResult | None
) -> tuple[Verdict, bool] | None:
    """(verdict, made without a model) or None when the budget refused the model call."""
    if result is None:
        return missing_result(task.attempt), True
    early = check_result(result, spec)
    if early is not None:
        log.info("review.deterministic", stop_reason=result.stop_reason, feedback=early.feedback)
        return early, True
    outcome = await rt.within_budget(
        goal.id,
        ask_for_verdict(
            rt.model_for(goal.id),
            system=REVIEW_SYSTEM,
            prompt=review_prompt(goal.goal, spec, result, task.feedback),
            max_tokens=rt.limits.model_max_tokens,
            metadata=_meta(goal.id, "review", task.task_id),
        ),
    )
    if outcome is None:
        return None
    if outcome.value is None:
        return unusable_verdict("; ".join(outcome.problems)), False
    return outcome.value, False


async def _apply(rt: Runtime, goal: GoalRecord, task: TaskRecord, verdict: Verdict, action: Action) -> bool:
    """Make the verdict's move and enqueue its follow-up. False when the attempt moved on meanwhile."""
    gid, tid, attempt = goal.id, task.task_id, task.attempt
    try:
        if action == "accept":
            moved = await rt.store.transition_task(
                gid, tid, TaskState.DONE, expected_attempt=attempt, expected_state=TaskState.REVIEWING
            )
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
            )
            await _ask_replan(rt, goal, tid, verdict.feedback)
    except (IllegalTransition, StaleWrite) as exc:
        log.info("review.stale", action=action, error=str(exc))
        return False
    log.info("review.applied", action=action, attempt=attempt, moved=moved)
    return moved


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


# -- review of the whole goal -----------------------------------------------------------------


async def review_goal(rt: Runtime, job: ReviewGoalJob) -> None:
    """Write the final answer from the accepted results, check it against the goal; succeed or replan."""
    goal = await rt.store.get_goal(job.goal_id)
    if goal.terminal or goal.plan_version != job.plan_version:
        log.info("review_goal.skipped", state=goal.state.value, plan_version=goal.plan_version)
        return
    if goal.state is GoalState.REPLANNING:
        # Failed by an earlier run that stopped before its enqueue; the job id dedupes.
        await rt.jobs.enqueue(ReplanJob(goal_id=goal.id, plan_version=goal.plan_version, reason=_goal_reason(None)))
        return
    if goal.state is not GoalState.REVIEWING:
        log.info("review_goal.skipped", state=goal.state.value)
        return
    answer = await _final_answer(rt, goal)
    if answer is None:
        return
    outcome = await rt.within_budget(
        goal.id,
        ask_for_verdict(
            rt.model_for(goal.id),
            system=GOAL_REVIEW_SYSTEM,
            prompt=goal_review_prompt(goal.goal, answer),
            max_tokens=rt.limits.model_max_tokens,
            metadata=_meta(goal.id, "review_goal"),
        ),
    )
    if outcome is None:
        return
    verdict = outcome.value or unusable_verdict("; ".join(outcome.problems))
    await _conclude(rt, goal, answer, verdict)


async def _final_answer(rt: Runtime, goal: GoalRecord) -> str | None:
    stored = await rt.store.get_plan(goal.id, goal.plan_version)
    results = await rt.store.latest_results(goal.id, [t.id for t in stored.plan.tasks])
    accepted = [(spec, results[spec.id]) for spec in stored.plan.tasks]
    response = await rt.within_budget(
        goal.id,
        write_answer(
            rt.model_for(goal.id),
            system=ANSWER_SYSTEM,
            prompt=answer_prompt(goal.goal, accepted, rt.limits.dependency_result_limit),
            max_tokens=rt.limits.model_max_tokens * ANSWER_TOKENS_FACTOR,
            metadata=_meta(goal.id, "final_answer"),
        ),
    )
    if response is None:
        return None
    if response.stop_reason != "stop":
        log.warning("review_goal.answer_incomplete", stop_reason=response.stop_reason)
    return response.text.strip()


async def _conclude(rt: Runtime, goal: GoalRecord, answer: str, verdict: Verdict) -> None:
    # A goal cannot be "retried": any failing verdict means the plan must change.
    action: Action = "accept" if verdict.passed else "replan"
    try:
        if verdict.passed:
            moved = await rt.store.transition_goal(goal.id, GoalState.SUCCEEDED, answer=answer)
        else:
            moved = await rt.store.transition_goal(goal.id, GoalState.REPLANNING, data={"feedback": verdict.feedback})
            reason = _goal_reason(verdict.feedback)
            await rt.jobs.enqueue(ReplanJob(goal_id=goal.id, plan_version=goal.plan_version, reason=reason))
    except IllegalTransition as exc:
        log.info("review_goal.stale", error=str(exc))  # cancelled (or stopped) while reviewing
        return
    log.info("review_goal.applied", action=action, moved=moved)
    if moved:
        await _emit(rt, goal.id, None, verdict, action, plan_version=goal.plan_version)


def _goal_reason(feedback: str | None) -> str:
    return "the final answer did not meet the goal's definition of done" + (f": {feedback}" if feedback else "")


# -- shared helpers ---------------------------------------------------------------------------


async def _emit(
    rt: Runtime, goal_id: str, task_id: str | None, verdict: Verdict, action: Action, **extra: int | bool
) -> None:
    data = {"passed": verdict.passed, "action": action, "feedback": verdict.feedback, **extra}
    await rt.events.emit(Event(type="critic.verdict", goal_id=goal_id, task_id=task_id, data=data))


def _meta(goal_id: str, purpose: str, task_id: str | None = None) -> dict[str, str]:
    return {"goal_id": goal_id, "role": "critic", "purpose": purpose, **({"task_id": task_id} if task_id else {})}


__all__ = ["review", "review_goal"]
