"""Fleet-wide rate limits: shared Redis token buckets, fair turns across tenants, 429 handling, and the
degrade switch, with the real SDK against the fake Messages API where a provider is involved."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from arq.connections import ArqRedis

from bus.events import EventLog
from bus.keys import Keys
from bus.ledger import Ledger
from bus.metered import Degrade, MeteredModel
from bus.prices import ModelPrice, PriceTable
from bus.ratelimit import RateLimit, RateLimiter, RateLimitTable, load_rate_limits
from llm.anthropic import AnthropicModel
from llm.errors import RetryableModelError
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, text_reply
from llm.testing.server import ProviderLimits
from llm.types import Message, ModelRequest
from taskloom.settings import Settings

TEST_KEY = "sk-ant-test"


def _request(max_tokens: int = 100) -> ModelRequest:
    return ModelRequest(messages=[Message.user("Refund order A100?")], max_tokens=max_tokens)


def test_limits_config_is_validated(tmp_path: Path) -> None:
    """Limits come from JSON text and/or a file (the text wins per model); bad input names the problem."""
    f = tmp_path / "limits.json"
    f.write_text('{"claude-sonnet-4": {"rpm": 50, "input_tpm": 30000}, "claude-haiku": {"rpm": 5}}')
    limits = load_rate_limits('{"claude-haiku": {"rpm": 9}}', f)
    assert limits["claude-haiku"].rpm == 9 and limits["claude-sonnet-4"].input_tpm == 30000
    with pytest.raises(ValueError, match="rpm"):
        load_rate_limits('{"m": {"rpm": -1}}')
    with pytest.raises(ValueError, match=r"extra|rps"):
        load_rate_limits('{"m": {"rps": 1}}')
    with pytest.raises(ValueError, match=r"rate_limits_file|No such file"):
        Settings(rate_limits_file=tmp_path / "missing.json")
    table = RateLimitTable(limits)
    found = table.find("claude-sonnet-4-5-20250929")
    assert found is not None and found[0] == "claude-sonnet-4"
    assert table.find("gpt") is None


@pytest.fixture
def limiter(redis: ArqRedis, keys: Keys) -> RateLimiter:
    # 600 input tokens a minute: 10 a second, so a short wait is measurable without a long test.
    return RateLimiter(redis, keys, {"m": RateLimit(input_tpm=600, output_tpm=60_000)})


async def test_a_call_over_the_limit_waits_instead_of_failing(limiter: RateLimiter) -> None:
    """A full bucket serves at once; a call past it waits until the bucket has refilled enough."""
    first = await limiter.acquire("m", "g", 600, 10, tenant="a")
    assert first is not None and first.waited < 0.5
    second = await limiter.acquire("m", "g", 5, 10, tenant="a")
    assert second is not None and second.waited >= 0.3  # 5 tokens at 10/s: never sooner
    assert await limiter.acquire("unlimited-model", "g", 10**6, 10) is None


async def test_unused_tokens_are_given_back(limiter: RateLimiter) -> None:
    """Settling a grant returns the unused part of the estimate, so the next call need not wait."""
    grant = await limiter.acquire("m", "g", 600, 10, tenant="a")
    assert grant is not None
    await limiter.settle(grant, 100, 10)
    nxt = await limiter.acquire("m", "g", 400, 10, tenant="a")
    assert nxt is not None and nxt.waited < 0.3


async def test_turns_are_fair_across_tenants(limiter: RateLimiter) -> None:
    """A tenant queueing many calls does not push another tenant's single call to the back."""
    await limiter.acquire("m", "g", 600, 1, tenant="busy")  # empties the bucket: everyone queues
    order: list[str] = []

    async def call(tenant: str, i: int) -> None:
        await limiter.acquire("m", "g", 3, 1, tenant=tenant)
        order.append(f"{tenant}{i}")

    busy = [asyncio.create_task(call("busy", i)) for i in range(5)]
    await asyncio.sleep(0.2)  # every busy call is queued before the quiet tenant's
    quiet = asyncio.create_task(call("quiet", 0))
    await asyncio.wait_for(asyncio.gather(*busy, quiet), timeout=60)
    assert order.index("quiet0") <= 1, order  # served first or second, not sixth


async def test_a_429_holds_every_caller_for_retry_after_and_shrinks_the_bucket(
    limiter: RateLimiter, redis: ArqRedis, keys: Keys
) -> None:
    """After the provider's 429, nobody's call starts before retry-after; the bucket is halved a while."""
    await limiter.throttled("m", 1.0)
    state = await limiter.state("m")
    assert float(state["factor"]) == 0.5 and int(state["throttled"]) == 1
    started = time.monotonic()
    await limiter.acquire("m", "g", 1, 1, tenant="a")
    assert time.monotonic() - started >= 0.8


@pytest.fixture
def server() -> AsyncIterator[FakeAnthropicServer]:
    # The provider allows 2 requests a minute and 1,000 output tokens a minute.
    with FakeAnthropicServer(limits=ProviderLimits(rpm=2, output_tpm=1000)) as fake:
        fake.respond_with(lambda r: text_reply("ok", output_tokens=10))
        yield fake


async def test_provider_429_and_remaining_headers_reach_the_limiter(
    server: FakeAnthropicServer, redis: ArqRedis, keys: Keys
) -> None:
    """A limiter configured too generously learns from the provider: the remaining headers lower its
    bucket, and a 429 (SDK retries off) blocks the bucket for the provider's retry-after."""
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, max_retries=0)
    limiter = RateLimiter(redis, keys, {"claude-test": RateLimit(rpm=100, output_tpm=100_000)})
    ledger = Ledger(redis, keys)
    await ledger.open("g", 100_000)
    metered = MeteredModel(model, ledger, "g", limiter=limiter)
    try:
        response = await metered.complete(_request(max_tokens=600))
        assert response.rate_limit is not None and response.rate_limit.output_tokens_remaining == 400
        assert float((await limiter.state("claude-test"))["out"]) < 1000  # lowered to the provider's view
        await metered.complete(_request(max_tokens=10))
        with pytest.raises(RetryableModelError) as info:
            await metered.complete(_request(max_tokens=10))  # the third request in a minute
        assert info.value.status == 429 and info.value.retry_after is not None
        state = await limiter.state("claude-test")
        sec, usec = await redis.time()
        assert float(state["blocked_until"]) > sec + usec / 1e6 + 10  # held for the minute it asked
        assert server.throttled == 1
        snap = await ledger.snapshot("g")
        assert (snap.calls, snap.releases, snap.reserved) == (2, 1, 0)  # the 429 cost nothing
    finally:
        await model.aclose()


async def test_degrade_switches_later_calls_to_the_fallback_once(redis: ArqRedis, keys: Keys) -> None:
    """Past the threshold, calls go to the fallback model, and the switch is one event."""

    def usage_of(request: RecordedRequest) -> Reply:
        return text_reply(f"from {request.body['model']}", output_tokens=400)

    with FakeAnthropicServer() as fake:
        fake.respond_with(usage_of)
        main = AnthropicModel("claude-main", api_key=TEST_KEY, base_url=fake.base_url, max_retries=0)
        cheap = AnthropicModel("claude-cheap", api_key=TEST_KEY, base_url=fake.base_url, max_retries=0)
        prices = PriceTable(
            {
                "claude-main": ModelPrice(input=10, output=10, cache_read=1, cache_write=10),
                "claude-cheap": ModelPrice(input=1, output=1, cache_read=0.1, cache_write=1),
            }
        )
        ledger = Ledger(redis, keys, prices=prices)
        events = EventLog(redis, keys)
        await ledger.open("g", 2000, tenant="acme")
        metered = MeteredModel(main, ledger, "g", events=events, degrade=Degrade(cheap, 0.3))
        try:
            models = [(await metered.complete(_request(max_tokens=400))).model for _ in range(3)]
        finally:
            await main.aclose()
            await cheap.aclose()
    # ~420 tokens a call: 0.21 of the budget spent before the second call, 0.42 before the third.
    assert models == ["claude-main", "claude-main", "claude-cheap"]
    degraded = [e for e in await events.read("g") if e.type == "goal.degraded"]
    assert len(degraded) == 1 and degraded[0].data["to"] == "claude-cheap"
