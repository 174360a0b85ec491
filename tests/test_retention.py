"""Retention (bus.retention, TASKLOOM_RETENTION): the keys of goals that ended long ago are deleted,
every one of them, and nothing of a goal still running or ended recently."""

from __future__ import annotations

import asyncio
import time

import pytest
from arq.connections import ArqRedis

from bus.client import Client
from bus.keys import ROLES, Keys
from bus.retention import purge_ended
from bus.store import NotFound
from llm import DemoModel
from taskloom.settings import Settings, SettingsError, load_settings
from taskloom.workers import run_workers

DEMO_GOAL = "Can orders A100 and A101 be refunded? Today is 2026-10-13."


async def _keys_of(redis: ArqRedis, keys: Keys, goal_id: str) -> list[str]:
    found = [k async for k in redis.scan_iter(match=f"{keys.goal(goal_id)}*", count=1000)]
    return sorted(k.decode() if isinstance(k, bytes) else str(k) for k in found)


async def test_ended_goals_lose_every_key_and_live_ones_keep_theirs(
    redis: ArqRedis, keys: Keys, settings: Settings
) -> None:
    """Two goals run to the end (plans, tasks, attempts, steps, ledger, events), a third waits:
    past the retention the two ended ones leave no key and no index entry; the waiting one is intact."""
    client = Client(redis, keys, default_budget_tokens=100_000)
    ended = [await client.submit(DEMO_GOAL), await client.submit(DEMO_GOAL.replace("A101", "A102"))]
    stop = asyncio.Event()
    fleet = asyncio.create_task(run_workers(list(ROLES), settings, stop=stop, model=DemoModel(latency=0)))
    try:
        for gid in ended:
            assert (await client.wait(gid, timeout=60)).state.value == "succeeded"
    finally:
        stop.set()
        await asyncio.wait_for(fleet, 30)
    waiting = await client.submit(DEMO_GOAL)  # no worker runs any more: it stays submitted
    before = {g: await _keys_of(redis, keys, g) for g in [*ended, waiting]}
    assert all(len(before[g]) > 10 for g in ended), before  # attempts, steps, effects... exist

    assert await purge_ended(redis, keys, retention=3600, now=time.time()) == 0  # ended just now: kept
    assert await purge_ended(redis, keys, retention=3600, now=time.time() + 7200) == 2
    for gid in ended:
        assert await _keys_of(redis, keys, gid) == []
        with pytest.raises(NotFound):
            await client.get(gid)
    assert await _keys_of(redis, keys, waiting) == before[waiting]
    assert [m.decode() for m in await redis.zrange(keys.goal_index(), 0, -1)] == [waiting]


def test_retention_must_outlive_a_reservation() -> None:
    """A retention shorter than a reservation's life is refused at start-up (a late settle would
    write into deleted books); 0 keeps goals for good."""
    with pytest.raises(SettingsError, match=r"TASKLOOM_RETENTION .* must exceed TASKLOOM_LEDGER_RESERVATION_TTL"):
        load_settings(retention=300, ledger_reservation_ttl=600)
    assert load_settings(retention=0).retention == 0
