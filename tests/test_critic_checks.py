"""The critic's deterministic checks and its verdict -> action decision (pure)."""

from __future__ import annotations

import pytest

from bus.runtime import Limits
from bus.schemas import TaskResult, TaskSpec, Verdict
from critic.checks import check_result, decide

SPEC = TaskSpec(id="t", title="t", instructions="do", definition_of_done="done", tools=["lookup_order"])
NO_TOOLS = SPEC.model_copy(update={"tools": []})


def result(answer: str = "42", stop: str = "answered", tool_calls: int = 1) -> TaskResult:
    return TaskResult(goal_id="g", task_id="t", attempt=1, answer=answer, stop_reason=stop, tool_calls=tool_calls)


@pytest.mark.parametrize(
    ("res", "spec", "feedback_has"),
    [
        (result(), SPEC, None),
        (result(tool_calls=0), NO_TOOLS, None),
        (result(stop="max_steps"), SPEC, "max_steps"),
        (result(stop="loop_detected"), SPEC, "loop_detected"),
        (result(stop="deadline"), SPEC, "deadline"),
        (result(stop="max_tokens"), SPEC, "cut off"),
        (result(stop="refusal"), SPEC, "refusal"),
        (result(stop="context_full"), SPEC, "context window"),
        (result(stop="error"), SPEC, "context_full"),  # the name a stored result may still carry
        (result(answer="  \n"), SPEC, "empty"),
        (result(tool_calls=0), SPEC, "lookup_order"),
    ],
    ids=[
        "ok",
        "ok-no-tools",
        "max-steps",
        "loop",
        "deadline",
        "max-tokens",
        "refusal",
        "context-full",
        "stored-as-error",
        "empty",
        "no-tool-call",
    ],
)
def test_check_result(res: TaskResult, spec: TaskSpec, feedback_has: str | None) -> None:
    """A result that did not answer, is empty, or skipped its required tools is a retry naming why."""
    verdict = check_result(res, spec)
    if feedback_has is None:
        assert verdict is None
    else:
        assert verdict is not None and verdict.action == "retry" and not verdict.passed
        assert feedback_has in verdict.feedback


ACCEPT = Verdict(passed=True, action="accept")
RETRY = Verdict(passed=False, action="retry", feedback="x")
REPLAN = Verdict(passed=False, action="replan", feedback="x")


@pytest.mark.parametrize(
    ("verdict", "attempt", "retries", "action"),
    [
        (ACCEPT, 1, 2, "accept"),
        (ACCEPT, 9, 2, "accept"),
        (RETRY, 1, 2, "retry"),
        (RETRY, 2, 2, "retry"),
        (RETRY, 3, 2, "replan"),
        (RETRY, 1, 0, "replan"),
        (REPLAN, 1, 2, "replan"),
    ],
)
def test_decide(verdict: Verdict, attempt: int, retries: int, action: str) -> None:
    """A retry beyond max_task_retries (attempt - 1 retries used) becomes a replan; other actions stand."""
    assert decide(verdict, attempt, Limits(max_task_retries=retries)) == action
