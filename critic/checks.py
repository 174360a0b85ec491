"""The critic's deterministic core: checks that need no model, and what a verdict leads to. Pure.

A result that did not answer (the loop stopped on a limit, the answer is empty, a task that must
use tools used none) is rejected here without spending a model call on it.
"""

from __future__ import annotations

from typing import Literal

from bus.runtime import Limits
from bus.schemas import TaskResult, TaskSpec, Verdict
from bus.stops import TaskStop, critic_feedback

Action = Literal["accept", "retry", "replan"]

# Why an attempt stopped, in words the next attempt (and an operator) can act on.
def check_result(result: TaskResult, spec: TaskSpec) -> Verdict | None:
    """A failing verdict when the result cannot pass whatever a model thinks of it; None otherwise."""
    if result.stop_reason != TaskStop.ANSWERED:
        why = critic_feedback(result.stop_reason)
        return _retry(f"No answer: {why} (stop reason: {result.stop_reason.value}).")
    if not result.answer.strip():
        return _retry("The answer was empty; give a complete answer that meets the definition of done.")
    if spec.tools and result.tool_calls == 0:
        tools = ", ".join(spec.tools)
        return _retry(
            f"The answer made no tool call, but this task must use its tools ({tools}); "
            "call them and base the answer on what they return."
        )
    return None


def _retry(feedback: str) -> Verdict:
    return Verdict(passed=False, action="retry", feedback=feedback)


def missing_result(attempt: int) -> Verdict:
    """The verdict when an attempt reached review but its result is not stored."""
    return _retry(f"No result was stored for attempt {attempt}; run the task again.")


def unusable_verdict(problem: str) -> Verdict:
    """The verdict when the reviewing model gave no valid verdict, even after a correction."""
    return _retry(f"The review could not be completed ({problem}); run the task again, meeting its definition of done.")


def decide(verdict: Verdict, attempt: int, limits: Limits) -> Action:
    """What to do with `verdict` on attempt `attempt` (1-based).

    A retry is allowed while fewer than `max_task_retries` retries were used (attempt - 1); after
    that the task is not going to pass as planned, so the plan itself must change.
    """
    if verdict.action == "retry" and attempt - 1 >= limits.max_task_retries:
        return "replan"
    return verdict.action
