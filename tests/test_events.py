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


async def test_next_position_says_whether_the_goal_state_moved_without_decoding(redis: ArqRedis, keys: Keys) -> None:
    """`next_position` (what Client.wait blocks on) returns the newest position and whether a
    `goal.state` event came; a task event whose data mentions that type does not count."""
    log = EventLog(redis, keys)
    g = "a" * 32
    first = await log.emit(Event(type="task.state", goal_id=g, task_id="t", data={"type": "goal.state"}))
    newest, moved = await log.next_position(g, None, 10, "goal.state")
    assert (newest, moved) == (first, False)
    second = await log.emit(Event(type="goal.state", goal_id=g, data={"state": "succeeded"}))
    assert await log.next_position(g, first, 10, "goal.state") == (second, True)
    assert await log.next_position(g, second, 10, "goal.state") == (None, False)  # nothing after it
