"""Event streams: typed events with positions, resumable from an offset, capped."""

from __future__ import annotations

import asyncio

from arq.connections import ArqRedis

from bus.events import EventLog
from bus.keys import Keys
from bus.schemas import Event


async def test_read_resumes_after_a_position(redis: ArqRedis, keys: Keys) -> None:
    """Reading after the position of the 2nd event yields exactly the 3rd onward, in order."""
    log = EventLog(redis, keys)
    for i in range(5):
        await log.emit(Event(type="test.tick", goal_id="g1", data={"i": i}))
    first = await log.read("g1")
    assert [e.data["i"] for e in first] == [0, 1, 2, 3, 4]
    rest = await log.read("g1", after=first[1].position)
    assert [e.data["i"] for e in rest] == [2, 3, 4]
    assert [e.data["i"] for e in await log.read("g1", after=first[-1].position)] == []


async def test_goal_events_also_reach_the_global_stream(redis: ArqRedis, keys: Keys) -> None:
    """Two goals' events interleave in the global stream, and each goal stream holds only its own."""
    log = EventLog(redis, keys)
    await log.emit(Event(type="test.a", goal_id="g1"))
    await log.emit(Event(type="test.b", goal_id="g2"))
    assert [e.goal_id for e in await log.read(None)] == ["g1", "g2"]
    assert [e.type for e in await log.read("g2")] == ["test.b"]


async def test_blocking_read_wakes_on_a_new_event(redis: ArqRedis, keys: Keys) -> None:
    """A watcher blocked on the stream receives an event emitted while it waits."""
    log = EventLog(redis, keys)
    pos = await log.emit(Event(type="test.first", goal_id="g1"))
    waiter = asyncio.create_task(log.read("g1", after=pos, block_ms=5000))
    await asyncio.sleep(0.05)
    await log.emit(Event(type="test.second", goal_id="g1"))
    got = await asyncio.wait_for(waiter, 3)
    assert [e.type for e in got] == ["test.second"]


async def test_streams_are_capped(redis: ArqRedis, keys: Keys) -> None:
    """With maxlen 100, writing 1,000 events keeps the stream near 100, not 1,000."""
    log = EventLog(redis, keys, maxlen=100)
    for i in range(1000):
        await log.emit(Event(type="test.tick", goal_id="g1", data={"i": i}))
    length = await redis.xlen(keys.goal_events("g1"))
    assert 100 <= length < 300
