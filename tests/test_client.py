"""The application client: submit validates and enqueues once, wait/events/cancel, reconciliation."""

from __future__ import annotations

import asyncio

import pytest
from arq.connections import ArqRedis
from pydantic import ValidationError

from bus.client import Client, WaitTimeout
from bus.jobs import Jobs, PlanJob
from bus.keys import Keys
from bus.schemas import GoalState
from bus.store import AlreadyExists, NotFound


async def _all_keys(redis: ArqRedis, prefix: str) -> list[bytes]:
    return [k async for k in redis.scan_iter(match=f"*{prefix}*")]


async def test_submit_stores_emits_and_enqueues_with_a_deterministic_job_id(redis: ArqRedis, keys: Keys) -> None:
    """A submitted goal is stored `submitted`, has a goal.submitted event, and one planner job."""
    client = Client(redis, keys, default_budget_tokens=5000)
    gid = await client.submit({"text": "Can order A100 be refunded?", "definition_of_done": "yes or no"})
    goal = await client.get(gid)
    assert goal.state is GoalState.SUBMITTED and goal.budget_tokens == 5000
    assert [e.type async for e in client.events(gid, follow=False)] == ["goal.submitted"]
    queued = await redis.zrange(keys.queue("planner"), 0, -1)
    assert [q.decode() for q in queued] == [Jobs(redis, keys).job_id(PlanJob(goal_id=gid))]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"text": ""}, "text"),
        ({"text": "   "}, "text"),
        ({"text": "x", "budget_tokens": -1}, "budget_tokens"),
        ({"text": "x", "deadline": "2026-10-13T12:00:00"}, "deadline"),
        ({"text": "x", "colour": "red"}, "colour"),
    ],
)
async def test_invalid_goal_is_refused_naming_the_field_and_stores_nothing(
    redis: ArqRedis, keys: Keys, prefix: str, raw: dict[str, object], field: str
) -> None:
    """Each invalid goal raises a ValidationError whose location is the bad field; Redis stays empty."""
    client = Client(redis, keys, default_budget_tokens=5000)
    with pytest.raises(ValidationError) as exc:
        await client.submit(raw)
    assert field in {str(e["loc"][0]) for e in exc.value.errors()}
    assert await _all_keys(redis, prefix) == []


async def test_resubmitting_under_the_same_id_is_idempotent(redis: ArqRedis, keys: Keys) -> None:
    """Same id + same goal: same id back, one job; same id + another goal: AlreadyExists."""
    client = Client(redis, keys, default_budget_tokens=5000)
    assert await client.submit("hello", goal_id="mine-1") == "mine-1"
    assert await client.submit("hello", goal_id="mine-1") == "mine-1"
    assert await redis.zcard(keys.queue("planner")) == 1
    with pytest.raises(AlreadyExists):
        await client.submit("something else", goal_id="mine-1")


async def test_wait_returns_at_the_end_and_times_out_before(redis: ArqRedis, keys: Keys) -> None:
    """wait() times out on a running goal and returns the record as soon as the goal ends."""
    client = Client(redis, keys, default_budget_tokens=5000)
    gid = await client.submit("hello")
    with pytest.raises(WaitTimeout) as exc:
        await client.wait(gid, timeout=0.2)
    assert exc.value.state == "submitted"
    waiter = asyncio.create_task(client.wait(gid, timeout=10))
    await asyncio.sleep(0.1)
    await client.cancel(gid)
    goal = await asyncio.wait_for(waiter, 5)
    assert goal.state is GoalState.CANCELLED


async def test_events_follow_stops_when_the_goal_ends(redis: ArqRedis, keys: Keys) -> None:
    """A following reader sees every event, including the terminal one, then the iterator ends."""
    client = Client(redis, keys, default_budget_tokens=5000)
    gid = await client.submit("hello")

    async def collect() -> list[str]:
        return [f"{e.type}:{e.data.get('state', '')}" async for e in client.events(gid)]

    reader = asyncio.create_task(collect())
    await asyncio.sleep(0.1)
    await client.store.transition_goal(gid, GoalState.PLANNING)
    await client.cancel(gid)
    assert await asyncio.wait_for(reader, 5) == ["goal.submitted:", "goal.state:planning", "goal.state:cancelled"]


async def test_unknown_goal_is_not_found(redis: ArqRedis, keys: Keys) -> None:
    """get/status/cancel of an unknown or malformed id raise NotFound."""
    client = Client(redis, keys, default_budget_tokens=5000)
    for call in (client.get, client.status, client.cancel):
        with pytest.raises(NotFound):
            await call("no-such-id")
    with pytest.raises(NotFound):
        await client.get("../../etc")
