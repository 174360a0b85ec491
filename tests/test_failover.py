"""Failover along a model chain, with the fleet-wide circuit breaker: the real anthropic SDK against two
fake Messages API servers (a primary and its fallback), the real ledger and breaker on a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from arq.connections import ArqRedis

from bus.breaker import Breaker, BreakerPolicy, BreakerState, gate
from bus.events import EventLog
from bus.keys import Keys
from bus.ledger import Ledger
from bus.metered import MeteredModel, ModelRoute, candidates, fails_over
from bus.prices import ModelPrice, PriceTable
from bus.retry import TroubleClock
from llm.anthropic import AnthropicModel
from llm.errors import ModelConnectionError, ModelTimeoutError, RetryableModelError, TerminalModelError
from llm.testing import FakeAnthropicServer, overloaded, server_error, text_reply
from llm.types import Message, ModelRequest

KEY = "sk-ant-test"
PRICES = PriceTable(
    {
        "claude-primary": ModelPrice(input=3, output=15, cache_read=0.3, cache_write=3.75),
        "claude-backup": ModelPrice(input=1, output=5, cache_read=0.1, cache_write=1.25),
    },
    library=False,
)


def _request() -> ModelRequest:
    return ModelRequest(messages=[Message.user("Refund order A100?")], max_tokens=200)


@pytest.fixture
def servers() -> Iterator[tuple[FakeAnthropicServer, FakeAnthropicServer]]:
    with FakeAnthropicServer() as primary, FakeAnthropicServer() as backup:
        yield primary, backup


@pytest.fixture
async def chain(
    servers: tuple[FakeAnthropicServer, FakeAnthropicServer],
) -> AsyncIterator[tuple[AnthropicModel, AnthropicModel]]:
    primary = AnthropicModel("claude-primary", api_key=KEY, base_url=servers[0].base_url, max_retries=0)
    backup = AnthropicModel("claude-backup", api_key=KEY, base_url=servers[1].base_url, max_retries=0)
    yield primary, backup
    await primary.aclose()
    await backup.aclose()


def _metered(
    redis: ArqRedis, keys: Keys, chain: tuple[AnthropicModel, AnthropicModel], goal: str, policy: BreakerPolicy
) -> MeteredModel:
    return MeteredModel(
        ModelRoute(chain, ("strong", "cheap")),
        Ledger(redis, keys, prices=PRICES),
        goal,
        TroubleClock(redis, keys),
        events=EventLog(redis, keys),
        breaker=Breaker(redis, keys, policy),
        role="executor",
    )


async def _events(redis: ArqRedis, keys: Keys, goal: str) -> list[tuple[str, dict[str, object]]]:
    return [(e.type, e.data) for e in await EventLog(redis, keys).read(goal)]


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (BreakerState(), "call"),
        (BreakerState(count=3, now=10), "call"),
        (BreakerState(open_until=20, now=10), "skip"),
        (BreakerState(open_until=20, now=21), "probe"),
        (BreakerState(open_until=20, probe_at=21, now=22), "skip"),  # another worker probes it
        (BreakerState(open_until=20, probe_at=21, now=52), "probe"),  # that prober died: free again
    ],
)
def test_gate_table(state: BreakerState, expected: str) -> None:
    """Closed calls, open skips until the cool-down ends, then one probe at a time (a dead prober frees it)."""
    assert gate(state, cooldown=30) == expected


def test_what_fails_over() -> None:
    """Retryable failures (429/5xx/529, timeouts, refused connections) move on; a terminal one is raised."""
    assert fails_over(RetryableModelError("529", status=529))
    assert fails_over(ModelTimeoutError("slow"))
    assert fails_over(ModelConnectionError("refused"))
    assert not fails_over(TerminalModelError("400", status=400))
    assert not fails_over(ValueError("a bug"))
    assert candidates([BreakerState(open_until=5, now=1), BreakerState()], 30) == [(1, "call")]


async def test_a_dead_primary_fails_over_at_once_and_is_priced_at_the_fallback(
    redis: ArqRedis,
    keys: Keys,
    servers: tuple[FakeAnthropicServer, FakeAnthropicServer],
    chain: tuple[AnthropicModel, AnthropicModel],
) -> None:
    """A 529 from the primary moves the call to the fallback in the same call: one model.failover event,
    the ledger settles the fallback's usage at the fallback's price, the 529 costs nothing."""
    primary, backup = servers
    primary.respond_with(lambda _: overloaded())
    backup.respond_with(lambda _: text_reply("A100 can be refunded."))
    ledger = Ledger(redis, keys, prices=PRICES)
    await ledger.open("g1", 10_000)
    model = _metered(redis, keys, chain, "g1", BreakerPolicy(failures=3, window=60, cooldown=30))
    response = await model.complete(_request())
    assert response.text == "A100 can be refunded."
    assert len(primary.message_requests) == 1 and len(backup.message_requests) == 1
    events = await _events(redis, keys, "g1")
    failovers = [d for t, d in events if t == "model.failover"]
    assert len(failovers) == 1
    assert failovers[0]["from"] == "strong" and failovers[0]["to"] == "cheap" and failovers[0]["status"] == 529
    assert ("model.serving", {"role": "executor", "model": "cheap", "model_id": "claude-backup"}) in events
    books = await ledger.snapshot("g1")
    billed = backup.billed
    assert books.spent == billed.total and books.releases == 1 and books.calls == 1
    assert books.cost_micro_usd == PRICES.cost("claude-backup", billed)
    assert books.served_by == {"executor": "cheap"}


async def test_the_breaker_keeps_every_worker_off_a_dead_model_until_its_cool_down(
    redis: ArqRedis,
    keys: Keys,
    servers: tuple[FakeAnthropicServer, FakeAnthropicServer],
    chain: tuple[AnthropicModel, AnthropicModel],
) -> None:
    """After `failures` failures in the window the primary is skipped by every MeteredModel sharing the
    Redis (another worker's included) without a request; after the cool-down one probe goes to it, and
    its success closes the breaker."""
    primary, backup = servers
    primary.respond_with(lambda _: server_error(503))
    backup.respond_with(lambda _: text_reply("ok"))
    policy = BreakerPolicy(failures=2, window=60, cooldown=1.0)
    ledger = Ledger(redis, keys, prices=PRICES)
    for g in ("g1", "g2", "g3"):
        await ledger.open(g, 100_000)
    worker_a = _metered(redis, keys, chain, "g1", policy)
    worker_b = _metered(redis, keys, chain, "g2", policy)
    await worker_a.complete(_request())
    await worker_b.complete(_request())
    assert len(primary.message_requests) == 2  # the second failure opens the breaker
    for _ in range(3):
        await worker_b.complete(_request())
        await worker_a.complete(_request())
    assert len(primary.message_requests) == 2  # skipped by both, no request at all
    assert len(backup.message_requests) == 8
    await asyncio.sleep(1.1)
    primary.respond_with(lambda _: text_reply("back"))
    probes = await asyncio.gather(*(_metered(redis, keys, chain, "g3", policy).complete(_request()) for _ in range(4)))
    assert len(primary.message_requests) == 3  # one probe; the others still went to the fallback
    assert sorted(r.text for r in probes) == ["back", "ok", "ok", "ok"]
    assert (await worker_a.complete(_request())).text == "back"  # closed: the primary again
    assert not await redis.exists(keys.breaker("claude-primary"))


async def test_every_model_down_raises_the_last_error_for_the_job_layer(
    redis: ArqRedis,
    keys: Keys,
    servers: tuple[FakeAnthropicServer, FakeAnthropicServer],
    chain: tuple[AnthropicModel, AnthropicModel],
) -> None:
    """With every model of the chain failing, the call raises a retryable error (the job layer's patience
    applies); once all breakers are open, it raises at once with the time to the first probe, no request sent."""
    primary, backup = servers
    primary.respond_with(lambda _: overloaded())
    backup.respond_with(lambda _: server_error(502))
    ledger = Ledger(redis, keys, prices=PRICES)
    await ledger.open("g1", 10_000)
    model = _metered(redis, keys, chain, "g1", BreakerPolicy(failures=1, window=60, cooldown=30))
    with pytest.raises(RetryableModelError) as first:
        await model.complete(_request())
    assert first.value.status == 502
    sent = len(primary.requests) + len(backup.requests)
    with pytest.raises(RetryableModelError, match="cooling down") as cooling:
        await model.complete(_request())
    assert cooling.value.retry_after is not None and 0 < cooling.value.retry_after <= 30
    assert len(primary.requests) + len(backup.requests) == sent
    books = await ledger.snapshot("g1")
    assert books.spent == 0 and books.open == 0


async def test_a_terminal_error_does_not_fail_over(
    redis: ArqRedis,
    keys: Keys,
    servers: tuple[FakeAnthropicServer, FakeAnthropicServer],
    chain: tuple[AnthropicModel, AnthropicModel],
) -> None:
    """A 400 is the request's fault: the fallback would refuse it too, so it is raised, and the
    breaker does not count it."""
    primary, backup = servers
    primary.respond_with(lambda _: server_error(400))
    ledger = Ledger(redis, keys, prices=PRICES)
    await ledger.open("g1", 10_000)
    with pytest.raises(TerminalModelError):
        await _metered(redis, keys, chain, "g1", BreakerPolicy()).complete(_request())
    assert backup.requests == []
    assert not await redis.exists(keys.breaker("claude-primary"))
