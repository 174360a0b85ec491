"""One stop vocabulary: every `TaskStop` has its row in `STOPS`, and every way the executor's pure
decisions end an attempt is a `TaskStop` (no second list of stop actions beside it)."""

from __future__ import annotations

import typing

import pytest

from bus.schemas import TaskResult
from bus.stops import STOPS, TaskStop, critic_feedback
from executor import policy
from llm.types import ModelResponse, TextBlock, Usage

# Stops the executor settles itself: the task or goal ends without a critic's retry.
NO_RETRY = {TaskStop.ANSWERED, TaskStop.BUDGET_EXHAUSTED, TaskStop.CANCELLED}


def test_stops_has_a_row_for_every_member() -> None:
    assert set(STOPS) == set(TaskStop)
    assert all(info.meaning for info in STOPS.values())


@pytest.mark.parametrize("stop", sorted(set(TaskStop) - NO_RETRY))
def test_every_stop_the_critic_retries_has_its_own_feedback(stop: TaskStop) -> None:
    """The next attempt is told what went wrong in words, not a generic line with the enum's value."""
    feedback = STOPS[stop].feedback
    assert feedback is not None and critic_feedback(stop) == feedback


def test_the_loop_actions_name_no_stop_of_their_own() -> None:
    """`policy.Action` is the loop's own moves plus `TaskStop`: a stop is never a second string."""
    literal, stop = typing.get_args(policy.Action)
    assert stop is TaskStop
    assert not [a for a in typing.get_args(literal) if a.startswith("stop")]


def test_a_full_context_window_keeps_its_meaning_as_the_answer() -> None:
    reply = ModelResponse(content=[TextBlock(text="")], stop_reason="context_length", usage=Usage(), model="m")
    stop = policy.classify(reply, policy.LoopState(), requires_tools=False)
    assert stop is TaskStop.CONTEXT_FULL
    assert policy.stop_answer(stop, reply) == STOPS[TaskStop.CONTEXT_FULL].meaning


def test_a_result_stored_under_the_old_name_reads_as_context_full() -> None:
    stored = '{"goal_id": "g", "task_id": "t", "attempt": 1, "answer": "", "stop_reason": "error"}'
    assert TaskResult.model_validate_json(stored).stop_reason is TaskStop.CONTEXT_FULL
    with pytest.raises(ValueError, match="nonsense"):
        TaskStop("nonsense")
