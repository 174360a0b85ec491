"""Guards inside the store's Lua scripts that no other test reaches: each test here was written against a
hand-made mutant of bus/store.py (the guard removed) and fails on it."""

from __future__ import annotations

import pytest
from arq.connections import ArqRedis

from bus.events import EventLog
from bus.keys import Keys
from bus.schemas import Goal, GoalRecord, GoalState, Plan, TaskSpec, TaskState
from bus.store import IllegalTransition, Store

# The path from `submitted` to each ended state.
ROUTES = {
    GoalState.SUCCEEDED: [GoalState.PLANNING, GoalState.RUNNING, GoalState.REVIEWING, GoalState.SUCCEEDED],
    GoalState.FAILED: [GoalState.PLANNING, GoalState.FAILED],
    GoalState.CANCELLED: [GoalState.PLANNING, GoalState.RUNNING, GoalState.CANCELLED],
    GoalState.BUDGET_EXHAUSTED: [GoalState.PLANNING, GoalState.BUDGET_EXHAUSTED],
}


def _plan(*ids: str) -> Plan:
    return Plan(
        tasks=[TaskSpec(id=i, title=f"task {i}", instructions="do it", definition_of_done="done") for i in ids]
    )


@pytest.mark.parametrize("ended", list(ROUTES))
async def test_an_ended_goal_takes_no_new_plan(redis: ArqRedis, keys: Keys, ended: GoalState) -> None:
    """save_plan on a goal that has ended raises IllegalTransition and writes no plan, task or event."""
    store, log = Store(redis, keys), EventLog(redis, keys)
    assert await store.create_goal(GoalRecord(id="g1", goal=Goal(text="refund A100?"), budget_tokens=1000))
    for state in ROUTES[ended]:
        assert await store.transition_goal("g1", state)
    before_events = await log.read("g1")
    with pytest.raises(IllegalTransition) as exc:
        await store.save_plan("g1", _plan("a", "b"), expected_version=0)
    assert exc.value.current == ended.value
    goal = await store.get_goal("g1")
    assert goal.state is ended and goal.plan_version == 0
    assert await store.get_tasks("g1") == {}
    assert not await redis.exists(keys.plan("g1", 1))
    assert await log.read("g1") == before_events


async def test_a_live_goal_takes_its_first_plan(redis: ArqRedis, keys: Keys) -> None:
    """The same call on a goal still planning stores version 1 with pending tasks (the guard is not a wall)."""
    store = Store(redis, keys)
    assert await store.create_goal(GoalRecord(id="g1", goal=Goal(text="refund A100?"), budget_tokens=1000))
    assert await store.transition_goal("g1", GoalState.PLANNING)
    assert await store.save_plan("g1", _plan("a", "b"), expected_version=0) == 1
    assert set(await store.get_tasks("g1")) == {"a", "b"}


async def test_a_replan_does_not_reset_a_kept_task(redis: ArqRedis, keys: Keys) -> None:
    """save_plan creates task records only for new ids: a done task that the new plan keeps stays done."""
    store = Store(redis, keys)
    assert await store.create_goal(GoalRecord(id="g1", goal=Goal(text="refund A100?"), budget_tokens=1000))
    assert await store.transition_goal("g1", GoalState.PLANNING)
    await store.save_plan("g1", _plan("a"), expected_version=0)
    for state in (TaskState.READY, TaskState.RUNNING, TaskState.REVIEWING, TaskState.DONE):
        assert await store.transition_task("g1", "a", state, **({"attempt": 1} if state is TaskState.READY else {}))
    assert await store.save_plan("g1", _plan("a", "b"), expected_version=1, reason="replan") == 2
    tasks = await store.get_tasks("g1")
    assert tasks["a"].state is TaskState.DONE and tasks["a"].attempt == 1
    assert tasks["b"].state is TaskState.PENDING and tasks["b"].plan_version == 2


@pytest.mark.parametrize("ended", [GoalState.SUCCEEDED, GoalState.FAILED, GoalState.BUDGET_EXHAUSTED])
async def test_an_ended_goal_cannot_be_cancelled(redis: ArqRedis, keys: Keys, ended: GoalState) -> None:
    """cancel_goal refuses a goal that already ended: its state, reason and tasks stay as they were."""
    store = Store(redis, keys)
    assert await store.create_goal(GoalRecord(id="g1", goal=Goal(text="refund A100?"), budget_tokens=1000))
    for state in ROUTES[ended]:
        assert await store.transition_goal("g1", state)
    with pytest.raises(IllegalTransition):
        await store.cancel_goal("g1")
    goal = await store.get_goal("g1")
    assert goal.state is ended and goal.reason != "cancelled by request"


async def test_cancelling_a_submitted_goal_takes_it_off_the_submitted_index(redis: ArqRedis, keys: Keys) -> None:
    """A goal cancelled before any planner saw it is no longer listed as waiting to be planned."""
    store = Store(redis, keys)
    for gid in ("g1", "g2"):
        assert await store.create_goal(GoalRecord(id=gid, goal=Goal(text="refund A100?"), budget_tokens=1000))
    waiting = keys.submitted_index()
    assert set(await redis.zrange(waiting, 0, -1)) == {b"g1", b"g2"}
    assert await store.cancel_goal("g1")
    assert await redis.zrange(waiting, 0, -1) == [b"g2"]
