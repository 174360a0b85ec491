"""Live text (bus.live): the batching rule, and batches through a real Redis's Pub/Sub: in order, with
offsets that rebuild the text, a restart frame, and nothing published while nobody listens."""

from __future__ import annotations

import asyncio
import json

import pytest
from arq.connections import ArqRedis

from bus.keys import Keys
from bus.live import Batching, LiveFrame, LivePublisher, LiveTexts, Subscription, flush_due

B = Batching(interval=0.1, max_chars=400)


@pytest.mark.parametrize(
    ("pending", "since", "due"),
    [
        (0, 5.0, False),  # nothing waits: nothing to send, however long it has been
        (1, 0.0, False),
        (399, 0.099, False),
        (400, 0.0, True),  # enough characters: at once
        (1, 0.1, True),  # an interval passed: whatever waits
        (5000, 0.0, True),
    ],
)
def test_flush_due(pending: int, since: float, due: bool) -> None:
    assert flush_due(pending, since, B) is due


async def _collect(sub: Subscription, until: int, timeout: float = 3.0) -> list[LiveFrame]:
    frames: list[LiveFrame] = []
    while sum(len(f.text) for f in frames if f.type == "text") < until:
        frame = await sub.next(timeout)
        assert frame is not None, f"only {frames} arrived"
        frames.append(frame)
    return frames


async def test_a_listener_gets_ordered_batches_whose_offsets_rebuild_the_text(redis: ArqRedis, keys: Keys) -> None:
    publisher = LivePublisher(redis, keys, Batching(interval=0.05, max_chars=100))
    words = [f"w{i:03d} " for i in range(200)]  # 1000 characters
    async with Subscription(redis, keys, "g1") as sub:
        call = publisher.call("g1", "t1", 2, 3)
        for w in words:
            call(w)
            await asyncio.sleep(0.001)
        await call.close()
        frames = await _collect(sub, 1000)
    assert all((f.goal, f.task, f.attempt, f.step, f.type) == ("g1", "t1", 2, 3, "text") for f in frames)
    # In order, no gap, no overlap: each batch starts where the one before ended.
    assert [f.offset for f in frames] == [sum(len(g.text) for g in frames[:i]) for i in range(len(frames))]
    assert "".join(f.text for f in frames) == "".join(words)
    # Batched: at most max_chars (plus one delta) per message, far fewer messages than deltas.
    assert 10 <= len(frames) < 60 and max(len(f.text) for f in frames) <= 100 + 5


async def test_text_waiting_in_a_pause_goes_out_within_an_interval(redis: ArqRedis, keys: Keys) -> None:
    publisher = LivePublisher(redis, keys, Batching(interval=0.05, max_chars=400))
    async with Subscription(redis, keys, "g1") as sub:
        call = publisher.call("g1", "t1", 1, 0)
        call("Hello")
        frame = await sub.next(1.0)  # no further delta, no close: the timer sends it
        assert frame is not None and (frame.text, frame.offset) == ("Hello", 0)
        await call.close()


async def test_a_restart_frame_comes_first_and_text_starts_again_at_zero(redis: ArqRedis, keys: Keys) -> None:
    publisher = LivePublisher(redis, keys, Batching(interval=0.0, max_chars=1))
    async with Subscription(redis, keys, "g1") as sub:
        first = publisher.call("g1", "t1", 1, 0)
        first("part")
        await first.close()
        again = publisher.call("g1", "t1", 1, 0, restart=True)
        again("whole")
        await again.close()
        frames = [await sub.next(1.0) for _ in range(3)]
    assert [(f.type, f.offset, f.text) for f in frames if f is not None] == [
        ("text", 0, "part"),
        ("restart", 0, ""),
        ("text", 0, "whole"),
    ]


async def test_nobody_listening_publishes_nothing_and_asks_once_per_ttl(redis: ArqRedis, keys: Keys) -> None:
    """A pattern subscriber sees every PUBLISH but is no channel listener (PUBSUB NUMSUB counts none)."""
    publisher = LivePublisher(redis, keys, Batching(interval=0.0, max_chars=1), listener_ttl=60)
    watcher = redis.pubsub(ignore_subscribe_messages=True)
    await watcher.psubscribe(keys.live("*"))
    before = await _numsub_calls(redis)
    for step in range(3):
        call = publisher.call("g1", "t1", 1, step)
        for w in ["one ", "two ", "three "]:
            call(w)
        await call.close()
    assert await _numsub_calls(redis) - before == 1  # one question, answered "nobody" for the TTL
    assert await watcher.get_message(timeout=0.3) is None
    # Once someone listens (and the answer has aged), batches go out again.
    publisher.listener_ttl = 0
    async with Subscription(redis, keys, "g1") as sub:
        call = publisher.call("g1", "t1", 1, 9)
        call("now heard")
        await call.close()
        frame = await sub.next(1.0)
    assert frame is not None and frame.text == "now heard"
    seen = await watcher.get_message(timeout=1.0)
    assert seen is not None and json.loads(seen["data"])["text"] == "now heard"
    await watcher.aclose()


async def _numsub_calls(redis: ArqRedis) -> int:
    """PUBSUB calls, the listener checks (Redis 7 counts `pubsub|channels`, 6.2 all PUBSUB
    subcommands as `pubsub`)."""
    stats = await redis.info("commandstats")
    names = ("cmdstat_pubsub|channels", "cmdstat_pubsub|numsub", "cmdstat_pubsub")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in names)


async def test_one_check_answers_for_every_goal_of_the_process(redis: ArqRedis, keys: Keys) -> None:
    """200 calls of 200 goals starting together ask Redis once, and each learns whether its own
    goal is watched; after the TTL, the next call asks again and sees a watcher who came since."""
    now = [0.0]
    publisher = LivePublisher(redis, keys, listener_ttl=0.25, clock=lambda: now[0])
    before = await _numsub_calls(redis)
    async with Subscription(redis, keys, "g7"):
        answers = await asyncio.gather(*(publisher.listening(f"g{i}") for i in range(200)))
        assert [i for i, a in enumerate(answers) if a] == [7]
        assert await _numsub_calls(redis) - before == 1
        assert not await publisher.listening("g8") and await _numsub_calls(redis) - before == 1
        async with Subscription(redis, keys, "g8"):
            assert not await publisher.listening("g8")  # "nobody" is believed for the TTL
            now[0] = 0.3
            assert await publisher.listening("g8")
            assert await _numsub_calls(redis) - before == 2


async def test_a_prefix_with_glob_characters_matches_only_its_own_channels(redis: ArqRedis, keys: Keys) -> None:
    """The channel pattern escapes the key prefix: `*` in it is no wildcard, so another deployment's
    channels that the unescaped pattern would match do not count as this one's watchers."""
    odd = Keys(prefix=f"{keys.prefix}a*b:")
    other = Keys(prefix=f"{keys.prefix}aXb:")
    publisher = LivePublisher(redis, odd, listener_ttl=0)
    async with Subscription(redis, other, "g1"):
        assert not await publisher.listening("g1")
    async with Subscription(redis, odd, "g1"):
        assert await publisher.listening("g1")


def _text(task: str, offset: int, text: str, attempt: int = 1, step: int = 0) -> LiveFrame:
    return LiveFrame(type="text", goal="g", task=task, attempt=attempt, step=step, offset=offset, text=text)


def test_live_texts_place_each_piece_at_its_offset() -> None:
    texts = LiveTexts()
    texts.apply(_text("a", 0, "Hello "))
    texts.apply(_text("b", 0, "Other"))
    assert texts.apply(_text("a", 6, "world")).text == "Hello world"
    # A call that starts again at 0 (a re-run the watcher was not told about) replaces the text.
    assert texts.apply(_text("a", 0, "Hi")).text == "Hi"
    # A restart frame clears the task and counts; the next step or attempt starts afresh.
    cleared = texts.apply(LiveFrame(type="restart", goal="g", task="a", attempt=1, step=0))
    assert (cleared.text, cleared.restarted) == ("", 1)
    assert texts.apply(_text("a", 0, "new", step=1)).text == "new" and texts.tasks["a"].restarted == 1
    assert texts.apply(_text("a", 0, "next try", attempt=2)).text == "next try"
    # Joined mid-call: the piece is kept, marked as missing its start.
    late = texts.apply(_text("c", 40, "tail"))
    assert (late.text, late.gap) == ("tail", True)
    assert texts.tasks["b"].text == "Other"


async def test_a_call_streams_only_while_someone_watches_the_goal(redis: ArqRedis, keys: Keys) -> None:
    """Nobody watching: no sink, so the model call is a plain one (no stream, no batches)."""
    publisher = LivePublisher(redis, keys, listener_ttl=0)
    assert await publisher.sink("g1", "t1", 1, 0) is None
    async with Subscription(redis, keys, "g1") as sub:
        sink = await publisher.sink("g1", "t1", 1, 0, restart=True)
        assert sink is not None
        await sink.close()
        frame = await sub.next(1.0)
    assert frame is not None and frame.type == "restart"


async def test_a_known_listener_costs_no_check_and_one_publish_tells_it_left(redis: ArqRedis, keys: Keys) -> None:
    """While batches go out, PUBLISH's reply is the listener check: no PUBSUB NUMSUB per call; once the
    listener is gone, one PUBLISH (heard by nobody) says so, and the next batches are not sent."""
    publisher = LivePublisher(redis, keys, Batching(interval=0.0, max_chars=1), listener_ttl=60)
    checks, publishes = await _numsub_calls(redis), await _calls(redis, "publish")
    async with Subscription(redis, keys, "g1") as sub:
        for step in range(3):
            sink = await publisher.sink("g1", "t1", 1, step)
            assert sink is not None
            sink("words")
            await sink.close()
            assert (
                await sub.next(1.0) or LiveFrame(type="restart", goal="", task="", attempt=1, step=0)
            ).text == "words"
    assert await _numsub_calls(redis) - checks == 1
    late = publisher.call("g1", "t1", 1, 3)  # the listener has left
    for w in ["a", "b", "c"]:
        late(w)
        await asyncio.sleep(0.05)
    await late.close()
    assert await _calls(redis, "publish") - publishes == 3 + 1  # "a" learnt that nobody listens: not "b", "c"
    assert await _numsub_calls(redis) - checks == 1


async def _calls(redis: ArqRedis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_no_redis_answer_means_no_live_text_not_a_failed_call(keys: Keys) -> None:
    """The listener check against a Redis that refuses connections: no sink (the call goes on unstreamed)."""
    from redis.asyncio import Redis

    unreachable = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
    try:
        assert await LivePublisher(unreachable, keys).sink("g1", "t1", 1, 0) is None
    finally:
        await unreachable.aclose()
