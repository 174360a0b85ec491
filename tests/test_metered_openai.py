"""Metered calls to an OpenAI-compatible server through the real openai SDK: what a local server that
reports no usage costs (its worst case, flagged), never zero."""

from __future__ import annotations

import pytest
from arq.connections import ArqRedis

from bus.events import EventLog
from bus.keys import Keys
from bus.ledger import Ledger
from bus.metered import MeteredModel
from bus.prices import ModelPrice, PriceTable
from llm.openai import OpenAIModel
from llm.testing import FakeOpenAIServer, openai_text_reply
from llm.types import Message, ModelRequest

PRICES = PriceTable({"local-model": ModelPrice(input=1, output=2, cache_read=0.5, cache_write=1)}, library=False)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_without_usage_is_charged_its_worst_case_and_flagged(
    redis: ArqRedis, keys: Keys, stream: bool
) -> None:
    """A local server that sends no usage: the call succeeds, the ledger counts its whole reservation as
    spent (and its worst-case cost), flags it `usage_unknown`, and never counts it as free."""
    with FakeOpenAIServer(omit_usage=True) as server:
        server.enqueue(openai_text_reply("A100 can be refunded."))
        model = OpenAIModel(
            "local-model", api_key="none", base_url=server.base_url, max_retries=0, stream=stream,
            strict_validation=True,
        )
        ledger = Ledger(redis, keys, prices=PRICES)
        await ledger.open("g", 10_000)
        metered = MeteredModel(model, ledger, "g", events=EventLog(redis, keys), role="executor")
        request = ModelRequest(messages=[Message.user("Refund order A100?")], max_tokens=300)
        response = await metered.complete(request)
        await model.aclose()
    assert response.text == "A100 can be refunded." and not response.usage_reported
    books = await ledger.snapshot("g")
    assert books.usage_unknown == 1 and books.calls == 1 and books.open == 0
    assert books.spent == books.spent_unknown > 300  # the input estimate plus every output token allowed
    # The worst case the reserve script held: input at the dearest input rate, output at the output rate.
    price_in, price_out = PRICES.per_mtok_micro("local-model", books.spent - 300)
    worst = -(-((books.spent - 300) * price_in + 300 * price_out) // 1_000_000)
    assert books.cost_micro_usd == worst > 0
    assert books.served_by == {"executor": "local-model"}
