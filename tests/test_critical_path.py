"""The pure decisions behind the shorter critical path: how the planner's first reply is routed, the
plan of a routed goal, which attempts a final answer belongs to, machine checks and review policies."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from bus.schemas import Check, FinalVerdict, Goal, Plan, TaskRecord, TaskState
from bus.synthesis import accepted_key, speculation_key
from critic.checks import check_problems, machine_verdict, needs_model_review
from llm.types import ModelResponse, StopReason, TextBlock, ToolUseBlock, Usage
from planner.ask import route_of
from planner.prompts import DEFAULT_GOAL_DOD, ROUTED_TASK_ID, single_task_plan

# -- route first ----------------------------------------------------------------------------------


def reply(*blocks: Any, stop: StopReason = "tool_call") -> ModelResponse:
    return ModelResponse(content=list(blocks), stop_reason=stop, usage=Usage(), model="m")


def use(name: str, **args: Any) -> ToolUseBlock:
    return ToolUseBlock(id=f"toolu_{name}", name=name, input=args)


@pytest.mark.parametrize(
    ("response", "route"),
    [
        (reply(use("submit_plan", tasks=[])), "plan"),
        (reply(TextBlock(text="I will plan."), use("fetch", item="x"), use("submit_plan", tasks=[])), "plan"),
        (reply(use("fetch", item="x")), "tool"),
        (reply(use("fetch", item="x"), use("lookup", id="y")), "tool"),
        (reply(TextBlock(text="Paris."), stop="stop"), "text"),
        (reply(TextBlock(text="  "), stop="stop"), "unclear"),
        (reply(TextBlock(text="Par"), stop="length"), "unclear"),
        (reply(use("fetch", item="x"), stop="length"), "unclear"),
        (reply(TextBlock(text="I can't help with that."), stop="content_filter"), "unclear"),
    ],
    ids=["plan", "plan-beside-tools", "tool", "tools", "text", "blank", "text-cut", "tool-cut", "refusal"],
)
def test_route_of_the_first_reply(response: ModelResponse, route: str) -> None:
    """submit_plan wins whatever else was called; own tools route to one task; a complete text is a
    direct answer; anything cut off, refused or empty falls back to a forced plan."""
    assert route_of(response) == route


def test_a_routed_goal_is_one_task_done_when_the_goal_is() -> None:
    goal = Goal(text="What is in record 7?", definition_of_done="names the record", check={"pattern": "7"})
    plan = single_task_plan(goal, ["fetch"])
    [spec] = plan.tasks
    assert (spec.id, spec.tools, spec.depends_on) == (ROUTED_TASK_ID, ["fetch"], [])
    assert spec.definition_of_done == "names the record" and spec.check == goal.check
    # Without a definition of done, the goal's default one; a text answer's task has no tools.
    bare = single_task_plan(Goal(text="Hi?"), []).tasks[0]
    assert bare.definition_of_done == DEFAULT_GOAL_DOD and bare.tools == []


# -- which attempts a final answer is for ---------------------------------------------------------

PLAN = Plan.model_validate(
    {
        "tasks": [
            {"id": t, "title": t, "instructions": "do", "definition_of_done": "done", "tools": []}
            for t in ("a", "b", "c")
        ]
    }
)


def records(**states: tuple[TaskState, int]) -> dict[str, TaskRecord]:
    return {t: TaskRecord(goal_id="g", task_id=t, state=s, attempt=n) for t, (s, n) in states.items()}


def test_the_speculation_starts_once_every_task_has_a_result_and_concludes_only_when_all_are_accepted() -> None:
    review, done = TaskState.REVIEWING, TaskState.DONE
    running = records(a=(done, 1), b=(review, 1), c=(TaskState.RUNNING, 1))
    assert speculation_key(PLAN, running) is None and accepted_key(PLAN, running) is None
    all_in = records(a=(done, 1), b=(review, 1), c=(review, 2))
    key = speculation_key(PLAN, all_in)
    assert key is not None and accepted_key(PLAN, all_in) is None
    accepted = records(a=(done, 1), b=(done, 1), c=(done, 2))
    assert accepted_key(PLAN, accepted) == key == speculation_key(PLAN, accepted)


def test_a_rejected_review_makes_the_speculation_unusable() -> None:
    """The rejected task's next attempt is part of the key: what was written from the rejected
    result never matches the accepted attempts."""
    review, done = TaskState.REVIEWING, TaskState.DONE
    speculated = speculation_key(PLAN, records(a=(done, 1), b=(review, 1), c=(review, 1)))
    retrying = records(a=(done, 1), b=(TaskState.RETRYING, 2), c=(done, 1))
    assert speculation_key(PLAN, retrying) is None
    accepted = accepted_key(PLAN, records(a=(done, 1), b=(done, 2), c=(done, 1)))
    assert accepted is not None and accepted != speculated
    # A task missing from the records (not stored yet) is not "all in".
    assert speculation_key(PLAN, records(a=(done, 1), b=(done, 1))) is None


# -- machine checks and review policies -----------------------------------------------------------


def test_each_failed_condition_of_a_check_is_named() -> None:
    check = Check(
        tools_called=["fetch", "lookup"],
        pattern=r"record \d+",
        json_schema={"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}}},
    )
    problems = check_problems(check, "no json here", {"fetch"})
    assert len(problems) == 3
    assert "tools_called failed: lookup not called" in problems[0]
    assert "pattern failed" in problems[1] and "record \\\\d+" in problems[1]
    assert "json_schema failed: the answer is not JSON" in problems[2]
    wrong_type = check_problems(Check(json_schema=check.json_schema), '{"id": "seven"}', None)
    assert wrong_type == ["check json_schema failed at id: 'seven' is not of type 'integer'"]
    # tools_used None (a final answer): tools_called is not checked.
    assert check_problems(Check(tools_called=["fetch"]), "x", None) == []


def test_a_machine_verdict_accepts_or_retries_naming_the_check() -> None:
    check = Check(pattern="^Record c0-t0 reported")
    assert machine_verdict(check, "Record c0-t0 reported after 1 fetches.", set()).action == "accept"
    failed = machine_verdict(check, "I could not find it.", set())
    assert (failed.passed, failed.action) == (False, "retry")
    assert failed.feedback.startswith("Machine check failed: check pattern failed")


@pytest.mark.parametrize(
    ("policy", "final", "model_review"),
    [
        ("every_task", False, True),
        ("every_task", True, True),
        ("final_only", False, False),
        ("final_only", True, True),  # the only task's review is the goal's review
        ("none", False, False),
        ("none", True, False),
    ],
)
def test_review_policies(policy: Any, final: bool, model_review: bool) -> None:
    assert needs_model_review(policy, final) is model_review


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"text": "x", "review": "sometimes"}, "review"),
        ({"text": "x", "check": {}}, "at least one of tools_called, pattern, json_schema"),
        ({"text": "x", "check": {"pattern": "("}}, "pattern is not a valid regular expression"),
        ({"text": "x", "check": {"json_schema": {"type": "objekt"}}}, "json_schema is not a valid JSON Schema"),
        ({"text": "x", "check": {"regex": "a"}}, "check.regex"),
    ],
)
def test_bad_review_policies_and_checks_are_refused_naming_the_field(raw: dict[str, Any], names: str) -> None:
    with pytest.raises(ValidationError) as exc:
        Goal.model_validate(raw)
    assert names in str(exc.value)


def test_a_final_verdict_is_consistent() -> None:
    assert FinalVerdict(answer="42", passed=True, action="accept").passed
    for bad in (
        {"answer": "42", "passed": True, "action": "replan"},
        {"answer": "", "passed": True, "action": "accept"},
        {"answer": "42", "passed": False, "action": "replan"},  # no feedback
    ):
        with pytest.raises(ValidationError):
            FinalVerdict.model_validate(bad)
