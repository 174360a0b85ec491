"""Client.resume: a failed or budget_exhausted goal restarts, keeping accepted tasks; idempotent."""

from __future__ import annotations

import pytest
from arq.connections import ArqRedis

from bus.client import Client
from bus.keys import Keys
from bus.schemas import GoalState, Plan, TaskSpec, TaskState
from bus.store import IllegalTransition


async def _failed_goal(client: Client) -> str:
    gid = await client.submit({"text": "hello", "budget_tokens": 1000}, goal_id="r1")
    store = client.store
    await store.transition_goal(gid, GoalState.PLANNING)
    specs = [TaskSpec(id=t, title=t, instructions=f"do {t}", definition_of_done="done") for t in ("a", "b")]
    await store.save_plan(gid, Plan(tasks=specs), expected_version=0)
    await store.transition_goal(gid, GoalState.RUNNING)
    for t in ("a", "b"):
        await store.transition_task(gid, t, TaskState.READY, attempt=1)
        await store.transition_task(gid, t, TaskState.RUNNING, expected_attempt=1)
    await store.transition_task(gid, "a", TaskState.REVIEWING, expected_attempt=1)
    await store.transition_task(gid, "a", TaskState.DONE, expected_attempt=1)
    await store.transition_goal(gid, GoalState.FAILED, reason="provider trouble: 529 (request_id=req_9)")
    return gid


async def test_resume_keeps_accepted_tasks_and_reruns_the_rest(redis: ArqRedis, keys: Keys) -> None:
    """Done stays done, a task stopped mid-run is pending again, the goal runs, a plan job is queued."""
    client = Client(redis, keys, default_budget_tokens=1000)
    gid = await _failed_goal(client)
    await redis.delete(keys.queue("planner"))
    goal = await client.resume(gid, budget_tokens=5000)
    assert goal.state is GoalState.RUNNING and goal.reason is None and goal.resumes == 1
    assert goal.budget_tokens == 5000 and (await client.ledger.snapshot(gid)).budget == 5000
    tasks = await client.store.get_tasks(gid)
    assert tasks["a"].state is TaskState.DONE and tasks["b"].state is TaskState.PENDING
    assert await redis.zcard(keys.queue("planner")) == 1
    assert await redis.zscore(keys.active_index(), gid) is not None


async def test_resume_is_idempotent_and_refuses_ended_goals(redis: ArqRedis, keys: Keys) -> None:
    """A second resume changes nothing; a succeeded or cancelled goal cannot resume; a budget below
    what was spent is refused naming it."""
    client = Client(redis, keys, default_budget_tokens=1000)
    gid = await _failed_goal(client)
    await redis.hset(keys.ledger(gid), "spent", 500)  # as if 500 tokens had been spent
    with pytest.raises(ValueError, match="budget_tokens"):
        await client.resume(gid, budget_tokens=400)
    assert (await client.get(gid)).state is GoalState.FAILED  # nothing changed
    await client.resume(gid)
    queued = await redis.zcard(keys.queue("planner"))
    again = await client.resume(gid)
    assert again.state is GoalState.RUNNING and again.resumes == 1
    assert await redis.zcard(keys.queue("planner")) == queued
    await client.cancel(gid)
    with pytest.raises(IllegalTransition):
        await client.resume(gid)

