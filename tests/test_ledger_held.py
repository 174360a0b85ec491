"""Held settles (`Ledger.settle_later`): an executor's settle rides on the process's next reserve,
goes out on its own after the settle delay, or with `flush`; the books never lose a call.

Against a real Redis; the Redis-out-of-reach case runs its own server behind a TCP proxy. The metered
model's part runs the real SDK against the fake Messages API, whose bill is the proof."""

from __future__ import annotations

import asyncio
import time
import typing
from pathlib import Path

import pytest
import redis.exceptions
from arq.connections import ArqRedis
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from sentinel import SentinelCluster
from structlog.testing import capture_logs
from tcpproxy import TcpProxy

from bus.attempts import AttemptStore, LeaseLost, StepRecord
from bus.durability import NotReplicated, ReplicaWait, require
from bus.keys import Keys
from bus.ledger import FOLD_TRIES, BudgetExhausted, Ledger, LedgerSnapshot
from bus.metered import MeteredModel
from llm.anthropic import AnthropicModel
from llm.errors import RetryableModelError
from llm.testing import FakeAnthropicServer, server_error, text_reply
from llm.types import Message, ModelRequest, TextBlock, Usage

USAGE = Usage(input_tokens=120, output_tokens=80, cache_read_tokens=30)  # 230 tokens


def assert_exact(snap: LedgerSnapshot, calls: int, spent: int) -> None:
    """Every call settled: nothing reserved or open, and `spent` as the provider reported it."""
    assert (snap.reserved, snap.open, snap.calls, snap.spent, snap.spent_unknown) == (0, 0, calls, spent, 0)


async def _eventually(check: typing.Callable[[], typing.Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.02)


@pytest.fixture
def ledger(redis: ArqRedis, keys: Keys) -> Ledger:
    return Ledger(redis, keys, settle_delay=30)  # the timer never fires within a test


async def test_a_held_settle_rides_on_the_next_reserve(ledger: Ledger) -> None:
    """Held, the call's whole reservation stays on the books; the process's next reserve closes it
    (told 1, as `settle` returns) before deciding, with no write of its own."""
    await ledger.open("g", 100_000)
    first = await ledger.reserve("g", 300, 1000)
    told: list[int] = []
    await ledger.settle_later(first, USAGE, then=told.append)
    assert ledger.held == 1 and told == []
    held = await ledger.snapshot("g")
    assert (held.reserved, held.open, held.spent) == (1300, 1, 0)
    second = await ledger.reserve("g", 300, 1000)
    assert ledger.held == 0 and told == [1]
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.open, snap.calls, snap.spent) == (1300, 1, 1, 230)
    assert (snap.spent_input, snap.spent_output, snap.spent_cache_read) == (120, 80, 30)
    await ledger.settle(second, USAGE)
    assert_exact(await ledger.snapshot("g"), calls=2, spent=460)


async def test_the_processs_own_held_settles_never_make_a_reserve_refuse_or_shrink(ledger: Ledger) -> None:
    """With the first call's 1,300 still held, a budget of 1,900 leaves 600: the second call would
    be cut to 300 output tokens. Its held settle (230 used) closes first, so the second call gets
    its full 1,000; a third is then refused, and the second's held settle is still closed."""
    await ledger.open("g", 1900)
    first = await ledger.reserve("g", 300, 1000)
    await ledger.settle_later(first, USAGE)
    second = await ledger.reserve("g", 300, 1000)
    assert second.max_tokens == 1000
    await ledger.settle_later(second, Usage(input_tokens=300, output_tokens=1000))
    with pytest.raises(BudgetExhausted):
        await ledger.reserve("g", 300, 1000)  # 1900 - 230 - 1300 = 370 left: below 300 + 256
    assert ledger.held == 0
    snap = await ledger.snapshot("g")
    assert_exact(snap, calls=2, spent=1530)
    assert snap.refusals == 1


async def test_flush_closes_the_held_settles_of_every_goal(ledger: Ledger) -> None:
    """Settles held for several goals (more than one script's batch) all close with one flush."""
    goals = [f"g{i}" for i in range(3)]
    for goal in goals:
        await ledger.open(goal, 10**9)
    told: list[int] = []
    for _ in range(70):
        for goal in goals:
            res = await ledger.reserve(goal, 10, 100)
            await ledger.settle_later(res, USAGE, then=told.append)
    # Each reserve carried the settle held before it: only the last one is still held.
    assert ledger.held == 1 and len(told) == 209
    await ledger.flush()
    assert ledger.held == 0 and told == [1] * 210
    for goal in goals:
        assert_exact(await ledger.snapshot(goal), calls=70, spent=70 * 230)


async def test_a_flush_of_more_than_a_batch_closes_them_all(redis: ArqRedis, keys: Keys) -> None:
    """250 settles held at once (calls in flight together), then one flush: three scripts' worth."""
    ledger = Ledger(redis, keys, settle_delay=30)
    other = Ledger(redis, keys)  # another process's reserves: they carry nothing of this one's
    await ledger.open("g", 10**9)
    reservations = [await other.reserve("g", 10, 100) for _ in range(250)]
    for res in reservations:
        await ledger.settle_later(res, USAGE)
    assert ledger.held == 250
    await ledger.flush()
    assert ledger.held == 0
    assert_exact(await ledger.snapshot("g"), calls=250, spent=250 * 230)


async def test_a_held_settle_goes_out_on_its_own_after_the_delay(redis: ArqRedis, keys: Keys) -> None:
    """No reserve comes: the settle is sent within the delay, by the process's timer."""
    ledger = Ledger(redis, keys, settle_delay=0.05)
    await ledger.open("g", 10_000)
    await ledger.settle_later(await ledger.reserve("g", 300, 1000), USAGE)
    assert ledger.held == 1

    async def settled() -> bool:
        return ledger.held == 0 and (await ledger.snapshot("g")).open == 0

    await _eventually(settled, within=2.0)
    assert_exact(await ledger.snapshot("g"), calls=1, spent=230)


async def test_without_a_delay_each_settle_goes_out_at_once(redis: ArqRedis, keys: Keys) -> None:
    ledger = Ledger(redis, keys)  # settle_delay 0
    await ledger.open("g", 10_000)
    told: list[int] = []
    await ledger.settle_later(await ledger.reserve("g", 300, 1000), USAGE, then=told.append)
    assert ledger.held == 0 and told == [1]
    assert_exact(await ledger.snapshot("g"), calls=1, spent=230)


async def test_a_close_that_fails_in_redis_spares_the_other_closes_and_the_reserve(
    ledger: Ledger, redis: ArqRedis, keys: Keys
) -> None:
    """Goal h's books hold a word where a number belongs: its held close fails inside the script
    (logged, its reservation left to expire), while g's close and g's reserve go through."""
    await ledger.open("g", 10_000)
    await ledger.open("h", 10_000)
    res_h = await ledger.reserve("h", 10, 100)
    res_g = await ledger.reserve("g", 10, 100)
    await redis.hset(keys.ledger("h"), "spent_output", "lots")  # type: ignore[misc]
    told: list[tuple[str, int]] = []
    await ledger.settle_later(res_h, USAGE, then=lambda c: told.append(("h", c)))
    await ledger.settle_later(res_g, USAGE, then=lambda c: told.append(("g", c)))
    with capture_logs() as logs:
        await ledger.reserve("g", 10, 100)
    assert told == [("g", 1)] and ledger.held == 0
    failed = [e for e in logs if e["event"] == "ledger.close_failed"]
    assert [(e["goal_id"], e["reservation"]) for e in failed] == [("h", res_h.id)]
    assert "not an integer" in failed[0]["error"]
    snap = await ledger.snapshot("g")
    assert (snap.calls, snap.spent, snap.open) == (1, 230, 1)


async def test_a_reserve_that_fails_after_its_closes_still_books_them(
    ledger: Ledger, redis: ArqRedis, keys: Keys
) -> None:
    """A reserve that fails after the held closes riding on it ran (the goal's grant record is
    damaged) keeps what the closes wrote: their reservations are gone from the expiry set, so
    nothing would count them later. Sent again, they find nothing left to close."""
    await ledger.open("g", 10_000)
    first = await ledger.reserve("g", 10, 100)
    second = await ledger.reserve("g", 10, 100)
    # Books that now say they belong to a tenant, with a grant record that cannot be read.
    await redis.hset(keys.ledger("g"), mapping={"tenant": "t", "tg": "damaged"})  # type: ignore[misc]
    told: list[int] = []
    await ledger.settle_later(first, USAGE, then=told.append)
    await ledger.settle_later(second, USAGE, then=told.append)
    with pytest.raises(ResponseError, match="grant record is damaged"):
        await ledger.reserve("g", 10, 100)
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.open, snap.calls, snap.spent) == (0, 0, 2, 460)
    assert (snap.spent_input, snap.spent_output, snap.spent_cache_read) == (240, 160, 60)
    # The reserve failed, so the closes are held again.
    await ledger.flush()
    assert told == [0, 0] and ledger.held == 0
    assert await ledger.snapshot("g") == snap


async def test_with_a_replica_policy_held_settles_do_not_ride_on_unguarded_writes(redis: ArqRedis, keys: Keys) -> None:
    """Under TASKLOOM_REDIS_WAIT_REPLICAS an attempt's writes are not guarded, so a held settle is not
    handed to one (it would lose its WAIT); it still rides on the next reserve, a guarded write."""
    client = Redis(connection_pool=redis.connection_pool)  # the same server, a client of its own policy
    require(client, ReplicaWait(replicas=1, timeout=0.05))
    ledger = Ledger(client, keys, settle_delay=30)
    plain = Ledger(redis, keys)  # no replica here: only the writes under test go through the policy
    await plain.open("g", 10_000)
    await ledger.settle_later(await plain.reserve("g", 300, 1000), USAGE)
    assert ledger.held_call() is None and ledger.held == 1
    with pytest.raises(NotReplicated):  # no replica here: the reserve's WAIT times out
        await ledger.reserve("g", 300, 1000)
    assert ledger.held == 1  # given back: it may not have reached a replica


@pytest.fixture
def cut_off(tmp_path: Path) -> typing.Iterator[TcpProxy]:
    """A Redis of the test's own, reached through a proxy that can cut every connection."""
    with (
        SentinelCluster(tmp_path / "redis", replicas=0, sentinels=0) as server,
        TcpProxy(server.data_ports[0]) as proxy,
    ):
        yield proxy


async def test_settles_held_while_redis_is_out_of_reach_go_out_once_it_is_back(cut_off: TcpProxy) -> None:
    """Redis cannot be reached: a flush keeps the settle held, a reserve fails and keeps it too.
    Once Redis is back, the next flush closes it; a settle that failed FOLD_TRIES times is given
    up (logged): its reservation stays open, to be forfeited in full when it expires."""
    client = Redis.from_url(f"redis://127.0.0.1:{cut_off.port}/0", socket_timeout=2, socket_connect_timeout=2)
    ledger = Ledger(client, Keys(prefix="held:"), settle_delay=30)
    try:
        await ledger.open("g", 100_000)
        kept = await ledger.reserve("g", 300, 1000)
        lost = await ledger.reserve("g", 300, 1000)
        await ledger.settle_later(kept, USAGE)
        cut_off.cut()
        await ledger.flush()  # does not raise: the close is held for a later try
        with pytest.raises((redis.exceptions.ConnectionError, OSError)):
            await ledger.reserve("g", 300, 1000)
        assert ledger.held == 1
        cut_off.heal()
        await ledger.flush()
        assert ledger.held == 0
        snap = await ledger.snapshot("g")
        assert (snap.calls, snap.spent, snap.open, snap.reserved) == (1, 230, 1, 1300)

        await ledger.settle_later(lost, USAGE)
        cut_off.cut()
        with capture_logs() as logs:
            for _ in range(FOLD_TRIES):
                await ledger.flush()
        assert ledger.held == 0
        assert [e["reservation"] for e in logs if e["event"] == "ledger.close_failed"] == [lost.id]
        cut_off.heal()
        snap = await ledger.snapshot("g")
        assert (snap.calls, snap.open, snap.reserved) == (1, 1, 1300)  # open until it expires
    finally:
        await client.aclose()


# -- the metered model: which settles are held ------------------------------------------------------


def _step(index: int, text: str) -> StepRecord:
    turn = Message(role="assistant", content=[TextBlock(text=text)])
    return StepRecord(index=index, assistant=turn, stop_reason="end_turn")


def _request() -> ModelRequest:
    return ModelRequest(system="Be terse.", messages=[Message.user("Refund order A100?")], max_tokens=500)


async def test_a_metered_model_holds_every_success_and_the_books_match_the_bill(ledger: Ledger) -> None:
    """Each success is held (a failure's release is not); the next reserve carries what is held, and
    the first call's served model is written and announced once its settle ran. After a flush the
    books equal what the fake provider billed."""
    with FakeAnthropicServer() as server:
        claude = AnthropicModel("claude-test", api_key="sk-ant-test", base_url=server.base_url, max_retries=0)
        try:
            await ledger.open("g", 100_000)
            model = MeteredModel(claude, ledger, "g", role="executor", hold_settles=True)
            server.enqueue(
                text_reply("one", output_tokens=11),
                server_error(500, should_retry=True),
                text_reply("two", output_tokens=12),
            )
            await model.complete(_request())
            assert ledger.held == 1
            held = await ledger.snapshot("g")
            assert (held.calls, held.open, held.served_by) == (0, 1, {})
            with pytest.raises(RetryableModelError):
                await model.complete(_request())  # its reserve carried the first call's settle
            assert ledger.held == 0
            snap = await ledger.snapshot("g")
            assert (snap.calls, snap.releases, snap.open, snap.served_by) == (1, 1, 0, {"executor": "claude-test"})
            await model.complete(_request())
            assert ledger.held == 1
            await ledger.flush()
            snap = await ledger.snapshot("g")
            assert (snap.reserved, snap.open, snap.calls, snap.releases) == (0, 0, 2, 1)
            assert snap.spent == server.billed.total
        finally:
            await claude.aclose()


async def test_held_settles_ride_on_an_attempts_next_write(ledger: Ledger, redis: ArqRedis, keys: Keys) -> None:
    """An attempt's write (the step stored after a model call) carries the settles the process holds,
    in its own round trip: the books are exact once it returns, and the write's reply is its own."""
    await ledger.open("g", 100_000)
    store = AttemptStore(redis, keys, "g", "t", 1, ledger=ledger)
    assert await store.acquire("worker-1", 30)
    res = await ledger.reserve("g", 300, 1000)
    told: list[int] = []
    await ledger.settle_later(res, USAGE, then=told.append)
    await store.append_step(_step(0, "done"))
    assert ledger.held == 0 and told == [1]
    assert_exact(await ledger.snapshot("g"), calls=1, spent=230)
    assert [s.index for s in await store.steps()] == [0]
    # The lease lost: the write still raises as its own, and the settle it carried still ran.
    res = await ledger.reserve("g", 300, 1000)
    await ledger.settle_later(res, USAGE)
    await redis.delete(store.lease_key)  # another executor's now, as after an expiry
    with pytest.raises(LeaseLost):
        await store.append_step(_step(1, "late"))
    assert ledger.held == 0
    assert_exact(await ledger.snapshot("g"), calls=2, spent=460)
