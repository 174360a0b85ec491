"""Schemas: validation at the boundary, the model-facing tool contracts, the state machines."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from bus.schemas import (
    GOAL_TERMINAL,
    GOAL_TRANSITIONS,
    TASK_TERMINAL,
    TASK_TRANSITIONS,
    GoalState,
    Plan,
    TaskSpec,
    TaskState,
    Verdict,
    json_schema,
)


def test_submit_plan_schema_keeps_the_contract_field_names() -> None:
    """The `submit_plan` input schema exposes exactly the TaskSpec fields of the model protocol."""
    schema = json_schema(Plan)
    task = schema["$defs"]["TaskSpec"]["properties"]
    assert set(task) == {"id", "title", "instructions", "depends_on", "definition_of_done", "tools", "check"}
    assert set(schema["$defs"]["Check"]["properties"]) == {"tools_called", "pattern", "json_schema"}
    assert schema["required"] == ["tasks"]
    assert set(json_schema(Verdict)["properties"]) == {"passed", "feedback", "action"}
    assert json_schema(Verdict)["properties"]["action"]["enum"] == ["accept", "retry", "replan"]


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        ({"passed": True, "action": "accept"}, True),
        ({"passed": False, "feedback": "no deadline", "action": "retry"}, True),
        ({"passed": False, "feedback": "wrong plan", "action": "replan"}, True),
        ({"passed": True, "action": "retry"}, False),
        ({"passed": False, "feedback": "x", "action": "accept"}, False),
        ({"passed": False, "action": "retry"}, False),
        ({"passed": True, "action": "ship"}, False),
    ],
)
def test_verdict_must_be_consistent(raw: dict[str, object], ok: bool) -> None:
    """passed goes with accept; a failing verdict needs feedback; unknown actions are refused."""
    if ok:
        Verdict.model_validate(raw)
    else:
        with pytest.raises(ValidationError):
            Verdict.model_validate(raw)


@pytest.mark.parametrize("bad_id", ["", "has space", "dot.ted", "x" * 65])
def test_task_ids_must_be_plain(bad_id: str) -> None:
    """Task ids go into keys and tool idempotency keys, so only [A-Za-z0-9_-]{1,64} is accepted."""
    with pytest.raises(ValidationError):
        TaskSpec(id=bad_id, title="t", instructions="i", definition_of_done="d")


def test_the_reserved_task_id_is_refused_by_name() -> None:
    """A task named `ids` would overwrite the goal's task-id set in Redis: refused, and the message says why."""
    with pytest.raises(ValidationError, match="task id 'ids' is reserved"):
        Plan(tasks=[TaskSpec(id="ids", title="t", instructions="i", definition_of_done="d")])
    with pytest.raises(ValidationError, match="reserved"):
        TaskSpec(id="a", title="t", instructions="i", definition_of_done="d", depends_on=["ids"])
    assert TaskSpec(id="ids2", title="t", instructions="i", definition_of_done="d").id == "ids2"


def _reachable(transitions: dict, start: object) -> set[object]:  # type: ignore[type-arg]
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in transitions[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_state_machines_are_closed_and_reachable() -> None:
    """Every state is reachable from the start; goal terminals have no exit."""
    assert _reachable(GOAL_TRANSITIONS, GoalState.SUBMITTED) == set(GoalState)
    assert _reachable(TASK_TRANSITIONS, TaskState.PENDING) == set(TaskState)
    assert all(not GOAL_TRANSITIONS[s] for s in GOAL_TERMINAL)
    # A task that ended may only be dropped by a replan, never resumed; a dropped id may come back
    # in a later plan, as a fresh pending task.
    assert all(TASK_TRANSITIONS[s] <= {TaskState.SUPERSEDED} for s in TASK_TERMINAL - {TaskState.SUPERSEDED})
    assert TASK_TRANSITIONS[TaskState.SUPERSEDED] == {TaskState.PENDING}


@given(st.lists(st.sampled_from(list(GoalState)), max_size=30))
def test_any_walk_ends_in_a_terminal_state_or_keeps_going(walk: list[GoalState]) -> None:
    """Applying only legal moves from `submitted`, once terminal the goal never moves again."""
    state = GoalState.SUBMITTED
    for target in walk:
        if target in GOAL_TRANSITIONS[state]:
            assert state not in GOAL_TERMINAL
            state = target
