"""Tenant grants: a tenant's goal takes tokens and dollars from its period pool in one go, and its
calls reserve and settle in the goal's books alone until the grant runs short, its period ends, or
the tenant's settings change. The pool's books stay exact whenever they are read."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest
from arq.connections import ArqRedis
from structlog.testing import capture_logs

from bus.keys import Keys
from bus.ledger import BudgetExhausted, Ledger, Reservation
from bus.prices import ModelPrice, PriceTable
from bus.schemas import Goal, GoalRecord, GoalState
from bus.store import Store
from bus.tenants import Tenants
from llm.types import Usage

PRICES = PriceTable(
    {
        "m": ModelPrice(input=2, output=10, cache_read=0.2, cache_write=4),
        "n": ModelPrice(input=1, output=5, cache_read=0.1, cache_write=2),
    },
    defaults=False,
)


@pytest.fixture
def ledger(redis: ArqRedis, keys: Keys) -> Ledger:
    return Ledger(redis, keys, prices=PRICES, min_reservation=10)


async def raw(redis: ArqRedis, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (await redis.hgetall(key)).items()}


async def test_calls_under_a_grant_leave_the_pool_untouched_and_reading_it_reports_them(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys
) -> None:
    """After the first call takes a grant, later calls touch only the goal's books; the tenant's view
    reports the grant first, so it shows every call's spend, per model and kind."""
    await tenants.set("acme", budget_tokens=1_000_000, budget_usd=100)
    await ledger.open("g", 1_000_000, tenant="acme")
    pool = keys.pool("tenant:acme:all")
    usages = [
        ("m", Usage(input_tokens=100, output_tokens=50)),
        ("m", Usage(input_tokens=10, output_tokens=5, cache_read_tokens=20)),
        ("n", Usage(input_tokens=7, output_tokens=3, cache_write_tokens=4)),
        ("m", Usage(input_tokens=1, output_tokens=1)),
    ]
    model, usage = usages[0]
    r = await ledger.reserve("g", 200, 100, model=model)
    assert r.tenant_pool == "tenant:acme:all"
    await ledger.settle(r, usage, model=model)
    before = await raw(redis, pool)
    assert int(before["reserved"]) > 0  # the grant, held by the pool
    for model, usage in usages[1:]:
        r = await ledger.reserve("g", 200, 100, model=model)
        assert r.tenant_pool == "tenant:acme:all"
        await ledger.settle(r, usage, model=model)
    assert await raw(redis, pool) == before  # not one field changed

    view = await tenants.show("acme")
    books = view.periods[0].books
    goal = await ledger.snapshot("g")
    assert (books.reserved, books.open, books.reserved_micro_usd) == (0, 0, 0)
    assert (books.spent, books.cost_micro_usd, books.calls) == (goal.spent, goal.cost_micro_usd, 4)
    assert books.spent == sum(u.input_tokens + u.output_tokens + u.cache_read_tokens + u.cache_write_tokens
                              for _, u in usages)  # fmt: skip
    spend = {m.model: (m.input, m.output, m.cache_read, m.cache_write) for m in view.periods[0].models}
    assert spend == {"m": (111, 56, 20, 0), "n": (7, 3, 0, 4)}
    # Reported once: a second reading adds nothing.
    again = (await tenants.show("acme")).periods[0].books
    assert (again.spent, again.calls, again.cost_micro_usd) == (books.spent, 4, books.cost_micro_usd)


async def test_a_lowered_limit_binds_the_next_call_of_a_goal_holding_a_grant(
    ledger: Ledger, tenants: Tenants
) -> None:
    """`tenant set` ends every grant: the very next call decides on the pool under the new limit,
    though the goal's grant had room for it."""
    await tenants.set("acme", budget_tokens=1_000_000)
    await ledger.open("g", 1_000_000, tenant="acme")
    r = await ledger.reserve("g", 100, 100, model="m")
    await ledger.settle(r, Usage(input_tokens=100, output_tokens=100), model="m")
    assert (await ledger.reserve("g", 0, 500, model="m")).max_tokens == 500  # under the grant
    await tenants.set("acme", budget_tokens=200 + 500 + 60)  # spent 200, 500 in flight: 60 left
    assert (await ledger.reserve("g", 0, 500, model="m")).max_tokens == 60
    with pytest.raises(BudgetExhausted) as info:
        await ledger.reserve("g", 0, 500, model="m")
    assert info.value.pool == "tenant:acme:all"


async def test_a_goal_short_of_room_takes_back_what_other_grants_hold_unused(
    ledger: Ledger, tenants: Tenants
) -> None:
    """A grant never makes another goal of the tenant refuse or clamp: what it holds unused comes back."""
    await tenants.set("acme", budget_tokens=10_000)
    for g in ("a", "b"):
        await ledger.open(g, 100_000, tenant="acme")
    await ledger.reserve("a", 100, 100, model="m")  # in flight: 200, and a grant beyond it
    held = (await tenants.show("acme")).periods[0].books.reserved
    assert held == 200  # read after reporting: only the call in flight is held
    r = await ledger.reserve("b", 0, 9_800, model="m")
    assert r.max_tokens == 9_800
    with pytest.raises(BudgetExhausted):
        await ledger.reserve("a", 0, 10, model="m")


async def test_a_short_goal_takes_back_the_unused_grants_of_32_other_goals(ledger: Ledger, tenants: Tenants) -> None:
    """Up to 32 holders (`RECLAIM`), every grant's unused part comes back to a goal that is short: its
    call gets every token the pool has not spent."""
    await tenants.set("acme", budget_tokens=100_000)
    for i in range(32):
        await ledger.open(f"g{i}", 100_000, tenant="acme")
        r = await ledger.reserve(f"g{i}", 0, 100, model="m")
        await ledger.settle(r, Usage(input_tokens=40, output_tokens=60), model="m")
    await ledger.open("x", 100_000, tenant="acme")
    r = await ledger.reserve("x", 0, 100_000 - 32 * 100, model="m")
    assert r.max_tokens == 100_000 - 32 * 100
    books = (await tenants.show("acme")).periods[0].books
    assert (books.spent, books.reserved) == (3_200, 96_800)


async def test_a_grant_ended_by_new_settings_closes_its_calls_in_flight_on_its_own_pool(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys
) -> None:
    """A call in flight when its grant ended (here: the tenant moved to daily periods) settles on the
    pool it was reserved from; the goal's next report does not count it again."""
    await tenants.set("acme", budget_tokens=1_000_000)
    await ledger.open("g", 1_000_000, tenant="acme")
    first = await ledger.reserve("g", 100, 100, model="m")
    await ledger.settle(first, Usage(input_tokens=100, output_tokens=100), model="m")
    in_flight = await ledger.reserve("g", 50, 50, model="m")
    await tenants.set("acme", period="day")
    sec, _ = await redis.time()
    day = f"tenant:acme:{datetime.fromtimestamp(sec, UTC):%Y-%m-%d}"
    later = await ledger.reserve("g", 10, 10, model="m")
    assert later.tenant_pool == day
    await ledger.settle(in_flight, Usage(input_tokens=50, output_tokens=30), model="m")
    await ledger.settle(later, Usage(input_tokens=10, output_tokens=10), model="m")
    periods = {p.label: p.books for p in (await tenants.show("acme")).periods}
    old, new = periods["all"], periods[day.rsplit(":", 1)[1]]
    assert (old.spent, old.reserved, old.open, old.calls) == (280, 0, 0, 2)
    assert (new.spent, new.reserved, new.open, new.calls) == (20, 0, 0, 1)
    goal = await ledger.snapshot("g")
    assert old.spent + new.spent == goal.spent and old.cost_micro_usd + new.cost_micro_usd == goal.cost_micro_usd


async def test_a_grant_ends_with_its_period(ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys) -> None:
    """A monthly pool's grant runs to the first second of the next month (UTC), computed in the script."""
    await tenants.set("acme", period="month", budget_tokens=1_000_000)
    await ledger.open("g", 1_000_000, tenant="acme")
    await ledger.reserve("g", 10, 10, model="m")
    record = (await redis.hget(keys.ledger("g"), "tg")).decode().split("\n")
    sec, _ = await redis.time()
    now = datetime.fromtimestamp(sec, UTC)
    nxt = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    assert float(record[6]) == nxt.timestamp()
    assert record[9] == keys.pool(f"tenant:acme:{now:%Y-%m}") and record[10:] == ["m", f"tenant:acme:{now:%Y-%m}", "1"]


async def test_ending_a_goals_grant_gives_back_what_it_holds(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys
) -> None:
    """`end_grant` (retention runs it before deleting a goal's books, inside its transaction) reports
    the grant and gives back all but the calls in flight; the goal leaves the tenant's grant holders."""
    await tenants.set("acme", budget_tokens=1_000_000)
    await ledger.open("g", 1_000_000, tenant="acme")
    await ledger.open("h", 1_000_000, tenant="acme")
    r = await ledger.reserve("g", 100, 100, model="m")
    await ledger.settle(r, Usage(input_tokens=100, output_tokens=50), model="m")
    await ledger.reserve("h", 10, 10, model="m")
    pool = keys.pool("tenant:acme:all")
    assert int((await raw(redis, pool))["reserved"]) > 20
    assert await ledger.end_grant("g")
    assert not await ledger.end_grant("g")  # ended already
    async with redis.pipeline(transaction=True) as pipe:
        Ledger.end_grant_in(pipe, keys, "h")
        await pipe.execute()
    books = await raw(redis, pool)
    assert (int(books["reserved"]), int(books["spent"])) == (20, 150)  # h's call is still in flight
    assert await redis.smembers(keys.tenant_grants("acme")) == set()


async def test_an_older_workers_call_is_booked_on_the_pool_once(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys
) -> None:
    """During a rolling upgrade a worker without grants reserves on the pool itself (its record names
    the pool without '@'). A call it made before the goal's first grant settles on the pool directly,
    and the goal's reports never count it again."""
    await tenants.set("acme", budget_tokens=1_000_000)
    await ledger.open("g", 1_000_000, tenant="acme")
    # What an older worker's reserve writes: 300 tokens on the goal and on the pool, its record in the set.
    pool, goal = keys.pool("tenant:acme:all"), keys.ledger("g")
    member = f"old1\n{goal}\n300\n0\nm\n{pool}"
    for key in (goal, pool):
        await redis.hincrby(key, "reserved", 300)
        await redis.hincrby(key, "open", 1)
    await redis.zadd(keys.ledger_expiry(), {member: 9e9})
    r = await ledger.reserve("g", 100, 100, model="m")  # the goal's first grant
    await ledger.settle(r, Usage(input_tokens=100, output_tokens=100), model="m")
    old = r._replace(id="old1", entry=member, amount=300, cost_micro=0)
    assert await ledger.settle(old, Usage(input_tokens=100, output_tokens=100), model="m")
    r = await ledger.reserve("g", 10, 10, model="m")
    await ledger.settle(r, Usage(input_tokens=10, output_tokens=10), model="m")
    books = (await tenants.show("acme")).periods[0].books
    snap = await ledger.snapshot("g")
    assert (books.spent, books.reserved, books.open, books.calls) == (snap.spent, 0, 0, 3) == (420, 0, 0, 3)


async def goal_with_a_grant(ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys) -> Store:
    """Goal `g` of tenant `acme`, just created, with one call settled under its grant (140 tokens)."""
    store = Store(redis, keys)
    await tenants.set("acme", budget_tokens=1_000_000)
    assert await store.create_goal(GoalRecord(id="g", goal=Goal(text="x", tenant="acme"), budget_tokens=10_000))
    await ledger.open("g", 10_000, tenant="acme")
    r = await ledger.reserve("g", 100, 100, model="m")
    await ledger.settle(r, Usage(input_tokens=100, output_tokens=40), model="m")
    return store


@pytest.mark.parametrize("end", ["succeeded", "cancelled"])
async def test_a_goal_that_ends_gives_back_its_grant(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys, end: str
) -> None:
    """The store ends a goal's grant when the goal ends (succeeded, failed, cancelled...): the pool's
    raw books then hold nothing for it and count its spend, without a read of the tenant."""
    store = await goal_with_a_grant(ledger, tenants, redis, keys)
    if end == "cancelled":
        assert await store.cancel_goal("g")
    else:
        for target in (GoalState.PLANNING, GoalState.RUNNING, GoalState.REVIEWING, GoalState.SUCCEEDED):
            assert await store.transition_goal("g", target)
    books = await raw(redis, keys.pool("tenant:acme:all"))
    figures = tuple(int(books.get(f, 0)) for f in ("reserved", "reserved_micro", "spent", "calls", "open"))
    assert figures == (0, 0, 140, 1, 0)
    assert await redis.smembers(keys.tenant_grants("acme")) == set()


async def test_a_goal_whose_grant_cannot_be_given_back_still_ends_and_says_so(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys
) -> None:
    """Giving the grant back follows the goal's move: a Redis error there is logged, not raised into a
    move that is done, and the grant is reported by the next report instead."""
    store = await goal_with_a_grant(ledger, tenants, redis, keys)
    pool = keys.pool("tenant:acme:all")
    books = await redis.hgetall(pool)
    await redis.delete(pool)
    await redis.set(pool, "not a hash")  # the pool's HINCRBY now fails with WRONGTYPE
    with capture_logs() as logs:
        assert await store.cancel_goal("g")
    assert (await store.get_goal("g")).state == GoalState.CANCELLED
    failed = [e for e in logs if e["event"] == "ledger.end_grant_failed"]
    assert len(failed) == 1 and failed[0]["goal_id"] == "g" and "WRONGTYPE" in failed[0]["error"]
    await redis.delete(pool)
    await redis.hset(pool, mapping=books)
    spent = (await tenants.show("acme")).periods[0].books
    assert (spent.spent, spent.reserved, spent.calls) == (140, 0, 1)


@pytest.mark.parametrize("seed", range(8))
async def test_spend_per_model_stays_exact_through_grants_refills_and_ends(
    ledger: Ledger, tenants: Tenants, seed: int
) -> None:
    """Calls of two models, many in flight at once, settled, forfeited or released in any order, over
    grants that run short, a change of settings that ends them, and two goals: the tenant's books show
    each model's spend by kind exactly, and the pool's totals are the goals' totals."""
    rng = random.Random(seed)
    await tenants.set("acme", budget_tokens=40_000, budget_usd=1)
    for g in ("a", "b"):
        await ledger.open(g, 10**9, tenant="acme")
    # per model: input, output, cache_read, cache_write, unknown, cost
    expected: dict[str, list[int]] = {"m": [0] * 6, "n": [0] * 6}
    open_calls: list[tuple[str, Reservation]] = []
    for step in range(60):
        if step == 30:
            await tenants.set("acme", budget_tokens=60_000)  # ends every grant, calls in flight included
        if open_calls and (len(open_calls) > 5 or rng.random() < 0.5):
            model, r = open_calls.pop(rng.randrange(len(open_calls)))
            action = rng.choice(("settle", "settle", "settle", "forfeit", "release"))
            if action == "settle":
                usage = Usage(
                    input_tokens=rng.randint(0, 50), output_tokens=rng.randint(0, 30),
                    cache_read_tokens=rng.choice((0, 7)), cache_write_tokens=rng.choice((0, 3)),
                )  # fmt: skip
                assert await ledger.settle(r, usage, model=model)
                e = expected[model]
                for i, v in enumerate((usage.input_tokens, usage.output_tokens, usage.cache_read_tokens,
                                       usage.cache_write_tokens)):  # fmt: skip
                    e[i] += v
                e[5] += PRICES.cost(model, usage) or 0
            elif action == "forfeit":
                assert await ledger.forfeit(r)
                expected[model][4] += r.amount
                expected[model][5] += r.cost_micro
            else:
                assert await ledger.release(r)
        else:
            model = rng.choice(("m", "n"))
            r = await ledger.reserve(rng.choice(("a", "b")), 60, 40, model=model)
            open_calls.append((model, r))
    view = await tenants.show("acme")
    books = view.periods[0].books
    got = {m.model: [m.input, m.output, m.cache_read, m.cache_write, m.unknown, round(m.cost_usd * 1_000_000)]
           for m in view.periods[0].models}  # fmt: skip
    assert got == {k: v for k, v in expected.items() if any(v)}
    snaps = [await ledger.snapshot(g) for g in ("a", "b")]
    assert books.spent == sum(s.spent for s in snaps) and books.cost_micro_usd == sum(s.cost_micro_usd for s in snaps)
    assert books.open == len(open_calls) == sum(s.open for s in snaps)
    assert books.reserved == sum(s.reserved for s in snaps)
