"""The critic's deterministic core: checks that need no model, and what a verdict leads to. Pure.

A result that did not answer (the loop stopped on a limit, the answer is empty, a task that must
use tools used none) is rejected here without spending a model call on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Literal

import jsonschema

from bus.runtime import Limits
from bus.schemas import Check, ReviewPolicy, TaskResult, TaskSpec, Verdict
from bus.stops import TaskStop, critic_feedback

Action = Literal["accept", "retry", "replan"]


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


# -- machine checks and review policies ---------------------------------------------------------


def check_problems(check: Check, answer: str, tools_used: Collection[str] | None) -> list[str]:
    """Every condition of `check` the answer fails, as a sentence naming the check. `tools_used`:
    the tools the attempt called (None: not known, e.g. a final answer, and `tools_called` is
    not checked)."""
    problems = []
    if check.tools_called and tools_used is not None:
        missing = [t for t in check.tools_called if t not in tools_used]
        if missing:
            problems.append(f"check tools_called failed: {', '.join(missing)} not called")
    if check.pattern is not None and re.search(check.pattern, answer) is None:
        problems.append(f"check pattern failed: the answer does not match {check.pattern!r}")
    if check.json_schema is not None:
        try:
            value = json.loads(answer)
        except ValueError as exc:
            problems.append(f"check json_schema failed: the answer is not JSON ({exc})")
        else:
            error = jsonschema.validators.validator_for(check.json_schema)(check.json_schema).iter_errors(value)
            first = next(iter(sorted(error, key=lambda e: list(e.absolute_path))), None)
            if first is not None:
                where = "/".join(str(p) for p in first.absolute_path) or "(root)"
                problems.append(f"check json_schema failed at {where}: {first.message}")
    return problems


def machine_verdict(check: Check, answer: str, tools_used: Collection[str] | None) -> Verdict:
    """The verdict of a machine check: accept, or retry with feedback naming each failed check."""
    problems = check_problems(check, answer, tools_used)
    if problems:
        return _retry("Machine check failed: " + "; ".join(problems) + ".")
    return Verdict(passed=True, action="accept", feedback="machine check passed")


def needs_model_review(policy: ReviewPolicy, final: bool) -> bool:
    """Whether a task's answer gets a model review. `final`: the task is the goal's only one, so its
    review is the goal's review too (kept under `final_only`)."""
    if policy == "every_task":
        return True
    return policy == "final_only" and final


def accepted_unreviewed(policy: ReviewPolicy) -> Verdict:
    return Verdict(passed=True, action="accept", feedback=f"accepted without a model review (review policy {policy})")
