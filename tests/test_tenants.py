"""Tenants and dollar budgets: the tenant's period pool is reserved in the same script as the goal."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from arq.connections import ArqRedis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from redis.asyncio import Redis

from bus.keys import Keys
from bus.ledger import BudgetExhausted, Ledger
from bus.prices import ModelPrice, PriceTable
from bus.schemas import Goal
from bus.tenants import TenantBusy, Tenants, period_label
from llm.types import Usage

# Round prices (USD per million tokens) so the expected costs are easy to read: input 2, output 10,
# cache read 0.2, cache write 4 (the dearest input rate, used for the worst case).
PRICES = PriceTable({"m": ModelPrice(input=2, output=10, cache_read=0.2, cache_write=4)}, defaults=False)


@pytest.fixture
def ledger(redis: ArqRedis, keys: Keys) -> Ledger:
    return Ledger(redis, keys, prices=PRICES, min_reservation=10)


@pytest.mark.parametrize(
    ("period", "at", "label"),
    [
        ("none", datetime(2026, 11, 30, 23, 59, tzinfo=UTC), "all"),
        ("day", datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC), "2026-11-30"),
        ("day", datetime(2026, 12, 1, 0, 0, tzinfo=UTC), "2026-12-01"),
        ("month", datetime(2024, 2, 29, 12, tzinfo=UTC), "2024-02"),
        ("month", datetime.fromisoformat("2026-12-31T23:30:00-02:00"), "2027-01"),  # UTC, not local
    ],
)
def test_period_label(period: str, at: datetime, label: str) -> None:
    """Periods follow the UTC calendar."""
    assert period_label(period, at) == label


def test_goal_tenant_defaults_and_is_validated() -> None:
    """A goal's tenant defaults to `default`; a name that cannot be a key part is refused."""
    assert Goal(text="x").tenant == "default"
    with pytest.raises(ValueError, match="tenant"):
        Goal(text="x", tenant="a:b")
    with pytest.raises(ValueError, match="budget_usd"):
        Goal(text="x", budget_usd=0)


@pytest.mark.parametrize("worker_skew_days", [0, -40, -1, 1, 400])
async def test_period_follows_redis_clock_not_the_workers_hint(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, monkeypatch: pytest.MonkeyPatch, worker_skew_days: int
) -> None:
    """The reserve script files spend under the same day and month labels as `period_label`, of
    Redis's clock: the worker passes its own day as a hint, and a worker clock days off changes nothing."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + worker_skew_days * 86400)
    for period in ("day", "month"):
        name = f"s{period}"
        await tenants.set(name, period=period)  # type: ignore[arg-type]
        await ledger.open(f"s{period}", 1000, tenant=name)
        res = await ledger.reserve(f"s{period}", 10, 10, model="m")
        sec, _ = await redis.time()
        assert res.tenant_pool == f"tenant:{name}:{period_label(period, datetime.fromtimestamp(sec, UTC))}"


async def test_tenant_pool_refuses_across_goals(ledger: Ledger, tenants: Tenants) -> None:
    """Goals of one tenant draw from its pool: the second goal is clamped, the third refused, a goal
    of another tenant is not affected."""
    await tenants.set("acme", budget_tokens=1000)
    for g in ("a", "b", "c"):
        await ledger.open(g, 10_000, tenant="acme")
    await ledger.open("other", 10_000, tenant="globex")
    r1 = await ledger.reserve("a", 100, 600, model="m")
    r2 = await ledger.reserve("b", 100, 600, model="m")
    assert (r1.amount, r2.max_tokens) == (700, 200)
    with pytest.raises(BudgetExhausted) as info:
        await ledger.reserve("c", 0, 100, model="m")
    assert info.value.pool == "tenant:acme:all" and info.value.unit == "tokens"
    assert (await ledger.reserve("other", 100, 600, model="m")).amount == 700
    view = await tenants.show("acme")
    assert view.periods[0].books.reserved == 1000 and view.periods[0].books.refusals == 1


async def test_dollar_budget_clamps_at_the_dearest_rate_and_settles_at_real_usage(ledger: Ledger) -> None:
    """The worst case prices input at the cache-write rate; settlement at the real kinds' rates."""
    # $0.01 = 10,000 micro-USD. 1000 input tokens at $4/M = 4,000; 6,000 left = 600 output at $10/M.
    await ledger.open("g", 1_000_000, budget_usd=0.01)
    res = await ledger.reserve("g", 1000, 5000, model="m")
    assert (res.max_tokens, res.cost_micro) == (600, 10_000)
    usage = Usage(input_tokens=500, cache_read_tokens=500, output_tokens=100)  # 1000 + 100 + 1000
    await ledger.settle(res, usage, model="m")
    snap = await ledger.snapshot("g")
    assert (snap.cost_micro_usd, snap.reserved_micro_usd) == (2100, 0)
    with pytest.raises(BudgetExhausted) as info:
        await ledger.reserve("g", 2000, 5000, model="m")  # 8,000 input + 10 output > 7,900 left
    assert info.value.unit == "usd" and info.value.budget == 10_000 and "dollar budget" in str(info.value)


async def test_dollar_budget_refuses_an_unpriced_model(ledger: Ledger) -> None:
    """A dollar limit cannot be kept on a model without a price: refused, not guessed."""
    await ledger.open("g", 10_000, budget_usd=1)
    with pytest.raises(BudgetExhausted) as info:
        await ledger.reserve("g", 10, 10, model="nope")
    assert info.value.unit == "unpriced" and "TASKLOOM_PRICES" in str(info.value)


async def test_lowering_below_spent_refuses_and_keeps_the_books(ledger: Ledger, tenants: Tenants) -> None:
    """A pool lowered below its spend refuses new calls; open reservations still settle and the
    books still balance."""
    await tenants.set("acme", budget_usd=1)
    await ledger.open("g", 100_000, tenant="acme")
    done = await ledger.reserve("g", 100, 100, model="m")
    await ledger.settle(done, Usage(input_tokens=100, output_tokens=100), model="m")  # 200 + 1000 micro
    held = await ledger.reserve("g", 100, 100, model="m")
    await tenants.set("acme", budget_usd=0.000_5)  # 500 micro-USD: below the 1,200 spent
    with pytest.raises(BudgetExhausted) as info:
        await ledger.reserve("g", 0, 10, model="m")
    assert info.value.pool == "tenant:acme:all" and info.value.unit == "usd"
    assert await ledger.settle(held, Usage(input_tokens=50, output_tokens=10), model="m")
    books = (await tenants.show("acme")).periods[0].books
    assert (books.cost_micro_usd, books.reserved_micro_usd, books.reserved, books.open) == (1400, 0, 0, 0)
    assert books.spent == books.spent_input + books.spent_output == 260
    await tenants.set("acme", budget_usd=0)  # no dollar limit any more
    await ledger.reserve("g", 0, 10, model="m")


async def test_spend_by_model_and_kind_and_reset(ledger: Ledger, tenants: Tenants) -> None:
    """The period pool keeps spend per model and kind (forfeits as unknown); reset zeroes the spend
    but keeps open reservations held."""
    await tenants.set("acme", budget_tokens=10_000)
    await ledger.open("g", 100_000, tenant="acme")
    r = await ledger.reserve("g", 100, 100, model="m")
    await ledger.settle(r, Usage(input_tokens=10, output_tokens=20, cache_read_tokens=30, cache_write_tokens=40))
    r = await ledger.reserve("g", 50, 50, model="m")
    await ledger.forfeit(r)
    held = await ledger.reserve("g", 5, 5, model="m")
    view = await tenants.show("acme")
    (m,) = view.periods[0].models
    assert (m.model, m.input, m.output, m.cache_read, m.cache_write, m.unknown) == ("m", 10, 20, 30, 40, 100)
    assert await tenants.reset("acme") == "tenant:acme:all"
    books = (await tenants.show("acme")).periods[0].books
    assert (books.spent, books.reserved, books.open, books.cost_micro_usd) == (0, 10, 1, 0)
    await ledger.settle(held, Usage(input_tokens=5, output_tokens=5))
    books = (await tenants.show("acme")).periods[0].books
    assert (books.spent, books.reserved, books.open) == (10, 0, 0)


async def test_pool_totals_by_kind_are_the_sums_over_models(
    ledger: Ledger, tenants: Tenants, redis: ArqRedis, keys: Keys
) -> None:
    """The period pool keeps its settled tokens by kind per model only (a settle writes fewer fields);
    its books show their sums, and books an older worker wrote with both layouts count each settle once."""
    await tenants.set("acme", budget_tokens=10_000)
    await ledger.open("g", 100_000, tenant="acme")
    for model, usage in (
        ("m", Usage(input_tokens=10, output_tokens=20, cache_read_tokens=3)),
        ("n", Usage(input_tokens=1, output_tokens=2, cache_write_tokens=4)),
    ):
        r = await ledger.reserve("g", 50, 50, model=model)
        await ledger.settle(r, usage, model=model)
    pool = keys.pool_prefix() + "tenant:acme:all"
    raw = await redis.hgetall(pool)
    assert not any(f.startswith(b"spent_") and f != b"spent_unknown" for f in raw), raw
    goal = await ledger.snapshot("g")  # a goal's books keep their totals as before
    view = await tenants.show("acme")
    books = view.periods[0].books
    for b in (books, goal):
        assert (b.spent_input, b.spent_output, b.spent_cache_read, b.spent_cache_write, b.spent) == (11, 22, 3, 4, 40)
    # An older worker's settle wrote the totals too: they are not counted a second time.
    await redis.hset(pool, mapping={"spent_input": 11, "spent_output": 22, "m:m:input": 110})
    books = (await tenants.show("acme")).periods[0].books
    assert (books.spent_input, books.spent_output) == (111, 22)


async def test_set_validates_and_is_partial(tenants: Tenants) -> None:
    """Unset options keep their value; bad values are refused before anything is written."""
    await tenants.set("acme", period="month", budget_usd=5)
    s = await tenants.set("acme", max_running=2)
    assert (s.period, s.budget_usd, s.max_running) == ("month", 5, 2)
    with pytest.raises(ValueError):
        await tenants.set("acme", budget_tokens=-1)
    with pytest.raises(ValueError, match="tenant name"):
        await tenants.set("a b")
    assert await tenants.names() == ["acme"]


async def test_running_slots(tenants: Tenants) -> None:
    """max_running slots: a holder renews its own, a third is refused until one is released."""
    await tenants.set("acme", max_running=2)
    await tenants.acquire_slot("acme", "g/1", 30)
    await tenants.acquire_slot("acme", "g/2", 30)
    await tenants.acquire_slot("acme", "g/1", 30)  # renewal, not a new slot
    with pytest.raises(TenantBusy):
        await tenants.acquire_slot("acme", "g/3", 30)
    await tenants.release_slot("acme", "g/1")
    await tenants.acquire_slot("acme", "g/3", 30)
    assert (await tenants.show("acme")).running == 2


# -- property: many goals of one tenant, concurrent, with crashes ---------------------------------


@dataclass
class Totals:
    micro: int = 0
    tokens: int = 0


async def _play(
    redis_url: str, prefix: str, pool_usd_micro: int, goal_usd_micro: int, plans: list[tuple[int, str, int, int, float]]
) -> None:
    redis = Redis.from_url(redis_url)
    keys = Keys(prefix=prefix)
    ledger = Ledger(redis, keys, prices=PRICES, min_reservation=16)
    crashing = Ledger(redis, keys, prices=PRICES, min_reservation=16, reservation_ttl=0.05)
    tenants = Tenants(redis, keys)
    tenant = "t" + uuid.uuid4().hex[:8]
    await tenants.set(tenant, budget_usd=pool_usd_micro / 1_000_000)
    goals = [f"g{i}" for i in range(4)]
    for g in goals:
        await ledger.open(g, 10**9, budget_usd=goal_usd_micro / 1_000_000, tenant=tenant)
    spent = {g: Totals() for g in goals}
    done = asyncio.Event()
    rng = random.Random(len(plans))

    async def call(goal_ix: int, action: str, inp: int, maxt: int, frac: float) -> None:
        goal = goals[goal_ix]
        await asyncio.sleep(rng.choice((0, 0, 0.001)))
        try:
            res = await (crashing if action == "crash" else ledger).reserve(goal, inp, maxt, model="m")
        except BudgetExhausted:
            return
        await asyncio.sleep(rng.choice((0, 0.001)))
        if action == "crash":  # the holder dies: expiry counts the worst case
            spent[goal].micro += res.cost_micro
            return
        # Any split of the reserved input among the kinds, output up to the clamped max_tokens.
        a = int(res.input_tokens * frac)
        b = int((res.input_tokens - a) * (1 - frac))
        usage = Usage(
            input_tokens=a, cache_read_tokens=b, cache_write_tokens=res.input_tokens - a - b,
            output_tokens=int(res.max_tokens * frac),
        )  # fmt: skip
        assert await ledger.settle(res, usage, model="m")
        cost = PRICES.cost("m", usage)
        assert cost is not None and cost <= res.cost_micro
        spent[goal].micro += cost

    async def monitor() -> None:
        while not done.is_set():
            view = await tenants.show(tenant)
            if view.periods:
                b = view.periods[0].books
                assert b.cost_micro_usd + b.reserved_micro_usd <= pool_usd_micro, b
            await asyncio.sleep(0)

    try:
        watcher = asyncio.create_task(monitor())
        await asyncio.gather(*(call(*p) for p in plans))
        done.set()
        await watcher
        await asyncio.sleep(0.06)
        await ledger.sweep()
        total = 0
        for g in goals:
            snap = await ledger.snapshot(g)
            assert snap.cost_micro_usd == spent[g].micro <= goal_usd_micro
            assert (snap.reserved, snap.reserved_micro_usd, snap.open) == (0, 0, 0)
            total += snap.cost_micro_usd
        periods = (await tenants.show(tenant)).periods  # none when every call was refused
        assert (periods[0].books.cost_micro_usd if periods else 0) == total <= pool_usd_micro
    finally:
        async for key in redis.scan_iter(match=f"{prefix}*", count=1000):
            await redis.delete(key)
        await redis.aclose()


@hsettings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pool_usd_micro=st.integers(min_value=1_000, max_value=60_000),
    goal_usd_micro=st.integers(min_value=500, max_value=30_000),
    plans=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3),
            st.sampled_from(("settle", "settle", "settle", "crash")),
            st.integers(min_value=0, max_value=1500),
            st.integers(min_value=1, max_value=2000),
            st.floats(min_value=0, max_value=1),
        ),
        min_size=1,
        max_size=24,
    ),
)
def test_no_goal_and_no_tenant_ever_a_cent_over(
    redis_url: str, prefix: str, pool_usd_micro: int, goal_usd_micro: int, plans: list[tuple[int, str, int, int, float]]
) -> None:
    """Concurrent goals of one tenant with random usages and crashed holders: no goal and no tenant
    ever spends (or holds) past its dollar budget, and every micro-dollar is accounted for."""
    asyncio.run(_play(redis_url, prefix, pool_usd_micro, goal_usd_micro, plans))
