"""The token-budget ledger: atomic reserve / settle / release / expiry against a real Redis."""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import re
import sys
import uuid
from asyncio.subprocess import PIPE
from dataclasses import dataclass

import pytest
from arq.connections import ArqRedis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from redis.asyncio import Redis

from bus.keys import Keys
from bus.ledger import (
    BudgetExhausted,
    Ledger,
    LedgerNotFound,
    LedgerSnapshot,
    PoolRef,
    Reservation,
    clamp_output,
    ledger_keys,
)
from bus.ledger_records import LedgerError, reservation_from_reply
from bus.prices import ModelPrice, PriceTable
from bus.replies import as_str
from bus.retry import TroubleClock
from bus.store import NotFound
from llm.types import Usage


async def pool_books(ledger: Ledger, name: str) -> LedgerSnapshot | None:
    """A pool's books as Redis holds them, after the sweep (None if no goal has used the pool yet)."""
    await ledger.sweep()
    raw = await ledger.redis.hgetall(ledger.keys.pool(name))  # type: ignore[misc]
    h = {as_str(k): as_str(v) for k, v in raw.items()}
    return LedgerSnapshot.from_hash(name, h) if "budget" in h else None


# -- pure decisions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headroom", "input_tokens", "max_tokens", "min_reservation", "expected"),
    [
        (10_000, 100, 1000, 256, 1000),  # room for all of it
        (1_100, 100, 1000, 256, 1000),  # exactly enough
        (900, 100, 1000, 256, 800),  # clamped to what is left
        (356, 100, 1000, 256, 256),  # clamped to exactly the minimum
        (355, 100, 1000, 256, 0),  # one short of the minimum: refuse
        (150, 100, 50, 256, 50),  # a small request needs only its own max_tokens
        (149, 100, 50, 256, 0),  # ... and is refused when even that does not fit
        (100, 100, 1000, 256, 0),  # nothing left after the input
        (0, 0, 1, 1, 0),  # no headroom at all
        (-50, 10, 100, 1, 0),  # overdrawn books (usage above an estimate)
        (1, 0, 1, 1, 1),  # the smallest call that fits
    ],
)
def test_clamp_output_table(
    headroom: int, input_tokens: int, max_tokens: int, min_reservation: int, expected: int
) -> None:
    """max_tokens is cut to the headroom left after the input, and refused (0) below the minimum."""
    assert clamp_output(headroom, input_tokens, max_tokens, min_reservation) == expected


@pytest.mark.parametrize(
    ("model", "usage", "expected"),
    [
        ("claude-sonnet-4-5-20250929", Usage(input_tokens=100_000), 300_000),
        # Past 200k input tokens Sonnet 4.5 costs its higher tier (genai-prices lists both).
        ("claude-sonnet-4-5-20250929", Usage(input_tokens=1_000_000), 6_000_000),
        ("us.anthropic.claude-sonnet-4-5-20250929-v1:0", Usage(input_tokens=1000), 3_000),  # Bedrock's id
        ("claude-sonnet-4-5@20250929", Usage(input_tokens=1000), 3_000),  # Vertex's id
        ("gpt-4o-mini", Usage(input_tokens=1000, cache_read_tokens=1000, output_tokens=1000), 150 + 75 + 600),
        ("claude-sonnet-4-5", Usage(output_tokens=1000, cache_read_tokens=1000), 15_000 + 300),
        ("claude-opus-4-5-20251101", Usage(input_tokens=1000), 5_000),  # not the older opus-4 price
        ("claude-opus-4-1", Usage(input_tokens=1000), 15_000),
        ("claude-haiku-4-5", Usage(cache_read_tokens=1), 1),  # 0.1 micro-USD rounds up, never down
        ("demo", Usage(input_tokens=10_000, output_tokens=10_000), 0),
        ("claude-unknown", Usage(input_tokens=1), None),
        (None, Usage(input_tokens=1), None),
    ],
)
def test_price_table(model: str | None, usage: Usage, expected: int | None) -> None:
    """Costs are integer micro-USD from genai-prices' database (tier by input size, Bedrock and Vertex ids
    included); unknown models have none."""
    assert PriceTable().cost(model, usage) == expected


@pytest.mark.parametrize(
    ("item", "value", "named"),
    [(1, 0, "max_tokens 0"), (2, 999, "amount 999 (input 500)"), (5, -1, "cost_micro -1"), (7, -5, "permille -5")],
)
def test_a_reserve_reply_that_breaks_the_reservations_rules_is_an_error_naming_it(
    item: int, value: int, named: str
) -> None:
    """The reply is checked though our own script wrote it: a record that lies about what was set
    aside would make the settle give back the wrong amount."""
    reply: list[object] = [b"ok", 1000, 1500, b"1765000000.123456", b"pool-a\npool-b", 12, b"", 250, b"rid\ngoal"]
    good = reservation_from_reply(reply, "rid", "g", 500, "m")
    assert (good.max_tokens, good.amount, good.pools, good.cost_micro, good.spent_fraction) == (
        1000,
        1500,
        ("pool-a", "pool-b"),
        12,
        0.25,
    )
    reply[item] = value
    with pytest.raises(LedgerError, match=re.escape(named)):
        reservation_from_reply(reply, "rid", "g", 500, "m")


def test_price_overrides_and_forfeit_prices() -> None:
    """An override wins over the defaults; the reserve script gets integer micro-USD per million,
    input at its dearest rate (here the cache-write rate)."""
    table = PriceTable({"claude-sonnet-4": ModelPrice(input=2.5, output=10, cache_read=0.25, cache_write=3)})
    assert table.per_mtok_micro("claude-sonnet-4-5") == (3_000_000, 10_000_000)
    assert table.source("claude-sonnet-4-5") == "configured"
    assert table.per_mtok_micro("claude-3-5-haiku") == (1_000_000, 4_000_000)
    assert table.source("claude-3-5-haiku") == "genai-prices"
    # A tiered model's worst case is the tier its input reaches, the highest without an estimate
    # (Sonnet 4.5 past 200k input: 7.5 cache write, 22.5 out).
    assert table.per_mtok_micro("claude-sonnet-4-5-20250929") == (3_000_000, 10_000_000)
    assert PriceTable().per_mtok_micro("claude-sonnet-4-5-20250929") == (7_500_000, 22_500_000)
    assert PriceTable().per_mtok_micro("claude-sonnet-4-5-20250929", 10_000) == (3_750_000, 15_000_000)
    assert table.per_mtok_micro("nope") == (0, 0)
    assert table.source("nope") is None
    assert PriceTable(library=False).price("claude-3-5-haiku") is None


# -- the books ------------------------------------------------------------------------------------


@pytest.fixture
def ledger(redis: ArqRedis, keys: Keys) -> Ledger:
    return Ledger(redis, keys)


async def test_open_is_idempotent(ledger: Ledger) -> None:
    """A second open of the same goal changes nothing, not even with another budget."""
    assert await ledger.open("g", 1000)
    assert not await ledger.open("g", 99_999)
    snap = await ledger.snapshot("g")
    assert (snap.budget, snap.spent, snap.reserved, snap.headroom) == (1000, 0, 0, 1000)


async def test_unopened_goal_is_a_typed_error(ledger: Ledger) -> None:
    """reserve and snapshot on a goal without books raise LedgerNotFound (a NotFound that pickles)."""
    with pytest.raises(LedgerNotFound) as caught:
        await ledger.reserve("ghost", 10, 100)
    assert isinstance(caught.value, NotFound) and caught.value.goal_id == "ghost"
    again = pickle.loads(pickle.dumps(caught.value))
    assert type(again) is LedgerNotFound and str(again) == str(caught.value)
    with pytest.raises(LedgerNotFound):
        await ledger.snapshot("ghost")


async def test_reserve_then_settle_records_usage_by_kind_and_cost(ledger: Ledger) -> None:
    """Settling moves the reservation out of `reserved` and the reported usage into `spent`."""
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 300, 1000, model="claude-sonnet-4-5")
    assert (res.input_tokens, res.max_tokens, res.amount) == (300, 1000, 1300)
    mid = await ledger.snapshot("g")
    assert (mid.reserved, mid.open, mid.headroom) == (1300, 1, 8700)
    usage = Usage(input_tokens=50, output_tokens=400, cache_read_tokens=200, cache_write_tokens=10)
    assert await ledger.settle(res, usage, model="claude-sonnet-4-5-20250929")
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.open, snap.calls) == (0, 0, 1)
    assert (snap.spent_input, snap.spent_output, snap.spent_cache_read, snap.spent_cache_write) == (50, 400, 200, 10)
    assert snap.spent == 660 and snap.headroom == 10_000 - 660
    assert snap.cost_micro_usd == PriceTable().cost("claude-sonnet-4-5", usage) == 150 + 6000 + 60 + 38


async def test_max_tokens_is_clamped_to_the_headroom(ledger: Ledger) -> None:
    """With 900 tokens left, a 100 + 1000 request is reserved as 100 + 800."""
    await ledger.open("g", 900)
    res = await ledger.reserve("g", 100, 1000)
    assert (res.max_tokens, res.amount) == (800, 900)
    assert (await ledger.snapshot("g")).headroom == 0


async def test_refusal_names_the_numbers_counts_and_pickles(ledger: Ledger) -> None:
    """Below the minimum output, reserve raises BudgetExhausted with the books' numbers; nothing is reserved."""
    await ledger.open("g", 1000)
    held = await ledger.reserve("g", 100, 600)
    with pytest.raises(BudgetExhausted) as caught:
        await ledger.reserve("g", 100, 1000)
    err = caught.value
    assert (err.goal_id, err.budget, err.spent, err.reserved, err.requested, err.pool) == ("g", 1000, 0, 700, 356, None)
    assert err.spent + err.reserved + err.requested > err.budget
    assert "budget 1000" in str(err) and "reserved 700" in str(err) and "356 needed" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is BudgetExhausted and vars(again) == vars(err) and str(again) == str(err)
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.refusals) == (held.amount, 1)


@pytest.mark.parametrize(
    ("headroom", "input_tokens", "max_tokens", "min_reservation"),
    [(5000, 100, 1000, 256), (900, 100, 1000, 256), (356, 100, 1000, 256), (355, 100, 1000, 256), (150, 100, 50, 256),
     (149, 100, 50, 256), (100, 100, 10, 1), (1, 0, 1, 1), (2000, 0, 4096, 1)],
)  # fmt: skip
async def test_reserve_script_clamps_like_clamp_output(
    redis: ArqRedis, keys: Keys, headroom: int, input_tokens: int, max_tokens: int, min_reservation: int
) -> None:
    """The Lua reserve reaches the same decision as the tested pure function."""
    ledger = Ledger(redis, keys, min_reservation=min_reservation)
    await ledger.open("g", headroom)
    expected = clamp_output(headroom, input_tokens, max_tokens, min_reservation)
    if expected == 0:
        with pytest.raises(BudgetExhausted):
            await ledger.reserve("g", input_tokens, max_tokens)
    else:
        assert (await ledger.reserve("g", input_tokens, max_tokens)).max_tokens == expected


async def test_settle_is_idempotent(ledger: Ledger) -> None:
    """A retried settle, or a release after it, returns False and changes nothing."""
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 100, 500)
    assert await ledger.settle(res, Usage(input_tokens=90, output_tokens=300))
    before = await ledger.snapshot("g")
    assert not await ledger.settle(res, Usage(input_tokens=90, output_tokens=300))
    assert not await ledger.settle(res, Usage(input_tokens=1, output_tokens=1))
    assert not await ledger.release(res)
    assert not await ledger.forfeit(res)
    assert await ledger.snapshot("g") == before


async def test_release_frees_the_reservation_once(ledger: Ledger) -> None:
    """A release gives the whole reservation back, spends nothing, and a second release is a no-op."""
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 100, 500)
    assert await ledger.release(res)
    assert not await ledger.release(res)
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.spent, snap.calls, snap.releases, snap.open) == (0, 0, 0, 1, 0)


async def test_forfeit_counts_the_full_amount_at_worst_case_cost(ledger: Ledger) -> None:
    """An unknown outcome is spent in full, as `unknown`, priced as input at the cache-write rate (the
    dearest an input token can cost) + max_tokens of output."""
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 100, 500, model="claude-sonnet-4-5")
    assert await ledger.forfeit(res)
    snap = await ledger.snapshot("g")
    assert (snap.spent, snap.spent_unknown, snap.reserved, snap.forfeits, snap.calls) == (600, 600, 0, 1, 1)
    assert snap.cost_micro_usd == 100 * 3.75 + 500 * 15 == res.cost_micro


async def test_orphaned_reservation_expires_at_its_full_amount(redis: ArqRedis, keys: Keys) -> None:
    """A holder that died never settles: after the TTL its reservation counts as spent, and a late
    settle (the outcome was already counted) changes nothing."""
    ledger = Ledger(redis, keys, reservation_ttl=0.2)
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 100, 900)
    await asyncio.sleep(0.3)
    snap = await ledger.snapshot("g")
    assert (snap.reserved, snap.spent, snap.spent_unknown, snap.expired, snap.open) == (0, 1000, 1000, 1, 0)
    assert not await ledger.settle(res, Usage(input_tokens=10, output_tokens=10))
    assert await ledger.snapshot("g") == snap


async def test_next_reserve_sweeps_expired_reservations(redis: ArqRedis, keys: Keys) -> None:
    """No background process: the reserve that needs the room forfeits the expired holder first."""
    short = Ledger(redis, keys, reservation_ttl=0.1)
    await short.open("g", 1000)
    await short.reserve("g", 0, 1000)
    with pytest.raises(BudgetExhausted):
        await short.reserve("g", 0, 1000)
    await asyncio.sleep(0.15)
    with pytest.raises(BudgetExhausted) as caught:  # expired, so spent: still no room, but not reserved
        await short.reserve("g", 0, 1000)
    assert (caught.value.spent, caught.value.reserved) == (1000, 0)
    assert await short.sweep() == 0


async def test_a_reserve_with_room_leaves_expired_reservations_to_the_sweep(redis: ArqRedis, keys: Keys) -> None:
    """A reserve that gets its full max_tokens does not sweep (one command less per call); the
    expired reservation is forfeited by the next sweep, snapshot or short reserve, never lost."""
    short = Ledger(redis, keys, reservation_ttl=0.1)
    await short.open("dead", 10_000)
    await short.open("alive", 10_000)
    await short.reserve("dead", 0, 2000)
    await asyncio.sleep(0.15)
    res = await short.reserve("alive", 0, 2000)
    assert res.max_tokens == 2000
    dead = await redis.hmget(keys.ledger("dead"), ["reserved", "expired"])  # type: ignore[misc]
    assert [int(v or 0) for v in dead] == [2000, 0]  # still held: nobody needed the room
    assert await short.sweep() == 1
    snap = await short.snapshot("dead")
    assert (snap.reserved, snap.spent_unknown, snap.expired, snap.open) == (0, 2000, 1, 0)


async def _as_earlier_version(redis: Redis, keys: Keys, res: Reservation, score: float) -> None:
    """Store `res` the way a worker of the earlier version did: a bare id in the expiry set, the
    record (the entry without its id line) in the `ledger:open` hash."""
    open_key, expiry_key, _ = ledger_keys(keys)
    assert await redis.zrem(expiry_key, res.entry) == 1
    await redis.zadd(expiry_key, {res.id: score})
    await redis.hset(open_key, res.id, res.entry.split("\n", 1)[1])  # type: ignore[misc]


async def test_a_reservation_of_the_earlier_layout_still_settles_and_expires(redis: ArqRedis, keys: Keys) -> None:
    """Reservations opened before an upgrade (record in the open hash) close normally after it."""
    ledger = Ledger(redis, keys, reservation_ttl=600)
    await ledger.open("g", 10_000, [PoolRef("tenant:t", 50_000)])
    res = await ledger.reserve("g", 100, 900)
    await _as_earlier_version(redis, keys, res, res.expires_at)
    old = res._replace(entry="")
    assert await ledger.settle(old, Usage(input_tokens=120, output_tokens=30))
    assert not await ledger.settle(old, Usage(input_tokens=120, output_tokens=30))  # idempotent
    gone = await ledger.reserve("g", 0, 500)
    await _as_earlier_version(redis, keys, gone, 1.0)  # long expired
    assert await ledger.sweep() == 1
    snap = await ledger.snapshot("g")
    pool = await pool_books(ledger, "tenant:t")
    assert pool is not None
    assert (snap.spent, snap.spent_unknown, snap.reserved, snap.open, snap.expired) == (650, 500, 0, 0, 1)
    assert (pool.spent, pool.reserved, pool.open) == (650, 0, 0)
    open_key, expiry_key, _ = ledger_keys(keys)
    assert await redis.hlen(open_key) == 0 and await redis.zcard(expiry_key) == 0  # type: ignore[misc]


async def test_usage_above_the_reservation_is_recorded_as_truth(ledger: Ledger) -> None:
    """An input estimate that was too low: the real usage is spent, the excess counted as overrun."""
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 10, 300)
    await ledger.settle(res, Usage(input_tokens=200, output_tokens=300))
    snap = await ledger.snapshot("g")
    assert (snap.spent, snap.overrun, snap.reserved) == (500, 190, 0)


async def test_unpriced_model_is_counted_not_guessed(ledger: Ledger) -> None:
    """A model without a price costs 0 and is counted as unpriced, so the gap is visible."""
    await ledger.open("g", 10_000)
    res = await ledger.reserve("g", 10, 300)
    await ledger.settle(res, Usage(input_tokens=10, output_tokens=10), model="claude-test")
    snap = await ledger.snapshot("g")
    assert (snap.cost_micro_usd, snap.unpriced) == (0, 1)


# -- pools ----------------------------------------------------------------------------------------


async def test_pool_refuses_though_the_goal_has_headroom(ledger: Ledger) -> None:
    """Two goals of one tenant: the second is refused by the tenant pool, named in the error."""
    tenant = PoolRef("tenant:acme", 1300)
    await ledger.open("g1", 10_000, [tenant, PoolRef("day:2026-11-29", 1_000_000)])
    await ledger.open("g2", 10_000, [PoolRef("tenant:acme", 999_999)])  # an existing pool keeps its budget
    r1 = await ledger.reserve("g1", 100, 1000)
    await ledger.settle(r1, Usage(input_tokens=100, output_tokens=1000))
    with pytest.raises(BudgetExhausted) as caught:
        await ledger.reserve("g2", 100, 1000)
    err = caught.value
    assert (err.pool, err.budget, err.spent, err.goal_id) == ("tenant:acme", 1300, 1100, "g2")
    assert "pool 'tenant:acme'" in str(err)
    pool = await pool_books(ledger, "tenant:acme")
    day = await pool_books(ledger, "day:2026-11-29")
    assert pool is not None and day is not None
    assert (pool.spent, pool.calls, pool.refusals, pool.reserved) == (1100, 1, 1, 0)
    assert (day.spent, day.refusals) == (1100, 0)
    g2 = await ledger.snapshot("g2")
    assert (g2.headroom, g2.refusals, g2.pools) == (10_000, 1, ["tenant:acme"])
    assert await pool_books(ledger, "tenant:nobody") is None


async def test_reservation_is_held_in_every_pool_and_clamped_by_the_tightest(ledger: Ledger) -> None:
    """A reservation counts in the goal and each pool; max_tokens is clamped to the tightest of them."""
    await ledger.open("g", 10_000, [PoolRef("tenant:a", 700), PoolRef("day:x", 5000)])
    res = await ledger.reserve("g", 100, 1000)
    assert res.max_tokens == 600 and res.pools == ("tenant:a", "day:x")
    for name in ("tenant:a", "day:x"):
        snap = await pool_books(ledger, name)
        assert snap is not None and snap.reserved == 700
    await ledger.release(res)
    snap = await pool_books(ledger, "tenant:a")
    assert snap is not None and (snap.reserved, snap.releases) == (0, 1)


async def test_any_reserve_settles_an_abandoned_goals_expired_reservation(redis: ArqRedis, keys: Keys) -> None:
    """Expiry is swept across goals: a goal nobody touches again still has its dead holder's
    reservation turned into spent, in its books and its pool's, by another goal's reserve."""
    short = Ledger(redis, keys, reservation_ttl=0.1)
    await short.open("dead", 10_000, [PoolRef("tenant:t", 3000)])
    await short.open("alive", 10_000, [PoolRef("tenant:t", 3000)])
    await short.reserve("dead", 0, 2000)
    await asyncio.sleep(0.15)
    res = await short.reserve("alive", 0, 2000)
    assert res.max_tokens == 1000  # the forfeited 2000 are spent, not free
    dead = await redis.hmget(keys.ledger("dead"), ["reserved", "spent_unknown", "expired"])  # type: ignore[misc]
    assert [int(v) for v in dead] == [0, 2000, 1]
    pool = await pool_books(short, "tenant:t")
    assert pool is not None and (pool.spent, pool.reserved) == (2000, 1000)


# -- concurrency ----------------------------------------------------------------------------------

ACTIONS = ("settle", "settle_twice", "release", "forfeit", "abandon")


@dataclass
class Tally:
    spent: int = 0
    calls: int = 0
    refused: int = 0


async def _cleanup(redis: Redis, prefix: str) -> None:
    async for key in redis.scan_iter(match=f"{prefix}*", count=1000):
        await redis.delete(key)


async def _play(redis_url: str, prefix: str, budget: int, plans: list[tuple[int, int, str, float]], seed: int) -> None:
    redis = Redis.from_url(redis_url)
    keys = Keys(prefix=prefix)
    ledger = Ledger(redis, keys, min_reservation=64)
    # The abandoning holders use a short TTL; everyone else's reservations never expire in the test.
    short = Ledger(redis, keys, min_reservation=64, reservation_ttl=0.05)
    goal = uuid.uuid4().hex
    rng = random.Random(seed)
    tally = Tally()
    done = asyncio.Event()
    await ledger.open(goal, budget)

    async def hop() -> None:
        await asyncio.sleep(rng.choice((0, 0, 0.001)))

    async def holder(inp: int, maxt: int, action: str, frac: float) -> None:
        await hop()
        try:
            res = await (short if action == "abandon" else ledger).reserve(goal, inp, maxt)
        except BudgetExhausted:
            tally.refused += 1
            return
        await hop()
        if action in ("settle", "settle_twice"):
            out = int(res.max_tokens * frac)
            inp = res.input_tokens
            usage = Usage(input_tokens=inp // 2, cache_read_tokens=inp // 3, output_tokens=out)
            assert await ledger.settle(res, usage)
            tally.spent, tally.calls = tally.spent + usage.total, tally.calls + 1
            if action == "settle_twice":
                await hop()
                assert not await ledger.settle(res, usage)
        elif action == "release":
            assert await ledger.release(res)
        elif action == "forfeit":
            assert await ledger.forfeit(res)
            tally.spent, tally.calls = tally.spent + res.amount, tally.calls + 1
        else:  # abandon: the holder dies; expiry will count the full amount
            tally.spent, tally.calls = tally.spent + res.amount, tally.calls + 1

    async def monitor() -> None:
        while not done.is_set():
            snap = await ledger.snapshot(goal)
            assert snap.spent + snap.reserved <= budget, snap
            assert snap.reserved >= 0 and snap.spent <= budget
            await asyncio.sleep(0)

    try:
        watcher = asyncio.create_task(monitor())
        await asyncio.gather(*(holder(*p) for p in plans))
        done.set()
        await watcher
        await asyncio.sleep(0.06)  # let every abandoned reservation expire
        snap = await ledger.snapshot(goal)
        assert (snap.reserved, snap.open) == (0, 0), snap
        assert snap.spent == tally.spent <= budget
        assert snap.spent == snap.spent_input + snap.spent_output + snap.spent_cache_read + snap.spent_unknown
        assert (snap.calls, snap.refusals) == (tally.calls, tally.refused)
    finally:
        await _cleanup(redis, prefix)
        await redis.aclose()


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budget=st.integers(min_value=200, max_value=6000),
    plans=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=400),
            st.integers(min_value=1, max_value=1500),
            st.sampled_from(ACTIONS),
            st.floats(min_value=0, max_value=1),
        ),
        min_size=1,
        max_size=16,
    ),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_interleavings_keep_the_books_balanced(
    redis_url: str, prefix: str, budget: int, plans: list[tuple[int, int, str, float]], seed: int
) -> None:
    """Concurrent reserve / settle / release / forfeit / expire: spent + reserved never exceeds the
    budget, and once everyone is done nothing stays reserved and spent is exactly what was used."""
    asyncio.run(_play(redis_url, prefix, budget, plans, seed))


# The done-when scenario, run by 4 separate processes: each does its share of reserve/settle pairs
# (5 at a time) and prints how many went through and how many were refused.
_WORKER = """
import asyncio, json, sys
from redis.asyncio import Redis
from bus.keys import Keys
from bus.ledger import BudgetExhausted, Ledger
from llm.types import Usage

async def main(url, prefix, goal, n):
    redis = Redis.from_url(url)
    ledger = Ledger(redis, Keys(prefix=prefix))
    counts = {"ok": 0, "refused": 0}

    async def pair():
        try:
            res = await ledger.reserve(goal, 100, 900)
        except BudgetExhausted:
            counts["refused"] += 1
            return
        await ledger.settle(res, Usage(input_tokens=res.input_tokens, output_tokens=res.max_tokens))
        counts["ok"] += 1

    for _ in range(n // 5):
        await asyncio.gather(*(pair() for _ in range(5)))
    await redis.aclose()
    print(json.dumps(counts))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


async def test_four_processes_thousand_pairs_stay_within_budget(
    redis: ArqRedis, keys: Keys, redis_url: str, prefix: str
) -> None:
    """1,000 reserve/settle pairs from 4 processes on a budget for about half: spent <= budget, nothing
    left reserved, and every pair either went through or was counted as refused."""

    ledger = Ledger(redis, keys)
    budget = 500_000  # each pair spends its whole reservation, 1,000 tokens when not clamped
    await ledger.open("shared", budget)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER, redis_url, prefix, "shared", "250", stdout=PIPE, stderr=PIPE
        )
        for _ in range(4)
    ]
    results = []
    for proc in procs:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode == 0, err.decode()
        results.append(json.loads(out))
    ok = sum(r["ok"] for r in results)
    refused = sum(r["refused"] for r in results)
    snap = await ledger.snapshot("shared")
    assert ok + refused == 1000
    assert snap.spent <= budget and snap.reserved == 0 and snap.open == 0
    assert (snap.calls, snap.refusals) == (ok, refused)
    assert 500 <= ok <= 501 and snap.headroom < 356  # clamping lets the last pair use the remainder
    open_key, expiry_key, _ = ledger_keys(keys)
    assert await redis.hlen(open_key) == 0 and await redis.zcard(expiry_key) == 0  # type: ignore[misc]


async def test_a_settle_that_ends_the_trouble_resets_the_goals_trouble_clock(ledger: Ledger) -> None:
    """The provider-trouble clock keeps its first stamp until a successful call's settle resets it."""
    clock = TroubleClock(ledger.redis, ledger.keys)
    await ledger.open("g", 10_000)
    assert await clock.failed("g", 1_000) == 1_000
    assert await clock.failed("g", 5_000) == 1_000  # the same trouble: it began at the first failure
    res = await ledger.reserve("g", 10, 100)
    assert await ledger.settle(res, Usage(input_tokens=10, output_tokens=5))  # not a success of the trouble
    assert await clock.failed("g", 6_000) == 1_000
    res = await ledger.reserve("g", 10, 100)
    assert await ledger.settle(res, Usage(input_tokens=10, output_tokens=5), end_trouble=True)
    assert await clock.failed("g", 9_000) == 9_000  # a new trouble
    assert (await ledger.snapshot("g")).spent == 30
