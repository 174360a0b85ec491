"""Streamed model calls (`complete(..., on_text=)`): each adapter hands out the reply's text as it
arrives, through the real SDKs against the fake servers, and still returns the very response a plain
call returns (content, stop reason, usage)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llm import Message, ModelRequest, ModelTimeoutError, ToolDef
from llm.anthropic import AnthropicModel
from llm.demo import DemoModel, word_chunks
from llm.openai import OpenAIModel
from llm.pacing import gulped
from llm.testing import FakeAnthropicServer, Reply, text_reply, tool_reply
from llm.testing.openai_server import FakeOpenAIServer
from llm.testing.openai_wire import openai_text_reply, openai_tool_reply

TEST_KEY = "sk-test-not-a-real-key"
LONG = " ".join(f"word{i}," for i in range(120)) + " and a last sentence with ünïcödé."
LOOKUP = ToolDef(
    name="lookup_order",
    description="Look up an order",
    input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)


def _request(**kwargs: Any) -> ModelRequest:
    fields: dict[str, Any] = {
        "system": "You are a support agent.",
        "max_tokens": 2048,
        "cache": False,  # a second identical call would otherwise read the first one's cache
        "tools": [LOOKUP],
        "messages": [Message.user("Can order A100 be refunded?")],
    }
    return ModelRequest.model_validate({**fields, **kwargs})


class Deltas(list[str]):
    def __call__(self, text: str) -> None:
        self.append(text)


# -- Anthropic --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        text_reply(LONG),
        tool_reply([("lookup_order", {"order_id": "A100"})], text="Let me look that up."),
    ],
    ids=["text", "text+tool"],
)
async def test_anthropic_stream_deltas_add_up_to_the_same_response(server: FakeAnthropicServer, reply: Reply) -> None:
    server.enqueue(reply)
    server.enqueue(reply)
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, strict_validation=True)
    deltas = Deltas()
    streamed = await model.complete(_request(), on_text=deltas)
    plain = await model.complete(_request())
    await model.aclose()
    assert server.requests[0].body.get("stream") is True and "stream" not in server.requests[1].body
    assert len(deltas) > 1 and "".join(deltas) == streamed.text != ""
    # The same reply either way: blocks, stop reason, usage (so the ledger settles the same).
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert streamed.stop_reason == plain.stop_reason
    assert streamed.usage == plain.usage and streamed.usage.output_tokens > 1
    assert streamed.request_id == server.requests[0].request_id


async def test_anthropic_tool_call_only_streams_no_text(server: FakeAnthropicServer) -> None:
    server.enqueue(tool_reply([("lookup_order", {"order_id": "A100"}), ("lookup_order", {"order_id": "A101"})]))
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, strict_validation=True)
    deltas = Deltas()
    response = await model.complete(_request(), on_text=deltas)
    await model.aclose()
    assert deltas == []
    assert [u.input for u in response.tool_uses] == [{"order_id": "A100"}, {"order_id": "A101"}]
    assert response.stop_reason == "tool_call"


async def test_anthropic_cut_stream_is_a_timeout_and_spent(server: FakeAnthropicServer) -> None:
    """A stream whose connection closes before its stop reason: ModelTimeoutError (maybe spent), after
    the text that did arrive was handed out."""
    server.enqueue(Reply(content=[{"type": "text", "text": LONG}], cut_after=6))
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, max_retries=0)
    deltas = Deltas()
    with pytest.raises(ModelTimeoutError) as caught:
        await model.complete(_request(), on_text=deltas)
    await model.aclose()
    assert caught.value.maybe_spent
    assert deltas and LONG.startswith("".join(deltas)) and "".join(deltas) != LONG


# -- OpenAI-compatible -------------------------------------------------------------------------------


async def test_openai_stream_deltas_add_up_to_the_same_response() -> None:
    with FakeOpenAIServer() as server:
        server.enqueue(openai_text_reply(LONG))
        server.enqueue(openai_text_reply(LONG))
        server.enqueue(openai_tool_reply([("lookup_order", {"order_id": "A100"})]))
        model = OpenAIModel("gpt-test", api_key=TEST_KEY, base_url=server.base_url, strict_validation=True)
        deltas, calls = Deltas(), Deltas()
        streamed = await model.complete(_request(), on_text=deltas)
        plain = await model.complete(_request())
        tools = await model.complete(_request(), on_text=calls)
        await model.aclose()
        assert server.requests[0].body.get("stream") is True and not server.requests[1].body.get("stream")
    assert len(deltas) > 1 and "".join(deltas) == streamed.text == LONG
    assert streamed.usage == plain.usage and streamed.content == plain.content
    assert calls == [] and [u.input for u in tools.tool_uses] == [{"order_id": "A100"}]


# -- the demo model and the scripted model -------------------------------------------------------------


def test_word_chunks_concatenate_to_the_text() -> None:
    for text in ["", "one", "  lead and trail  ", "a\nb\n\nc d e f g", LONG]:
        assert "".join(word_chunks(text)) == text
    assert word_chunks("a b c d e f g", 3) == ["a b c ", "d e f ", "g"]


async def test_demo_streams_a_few_words_at_a_time() -> None:
    model = DemoModel(latency=0.05)
    deltas = Deltas()
    request = _request(tools=[], messages=[Message.user(LONG)])
    streamed = await model.complete(request, on_text=deltas)
    assert streamed == await model.complete(request)
    assert len(deltas) > 3 and "".join(deltas) == streamed.text
    assert all(len(d.split()) <= 3 for d in deltas)
    calls = Deltas()
    tool_turn = await model.complete(_request(messages=[Message.user("Look up order A100")]), on_text=calls)
    assert tool_turn.tool_uses and calls == []


async def test_scripted_model_streams_its_executor_answers() -> None:
    from taskloom.testing import ScriptedModel

    model = ScriptedModel(executor=["first answer, written in a few words"])
    from executor.loop import SYSTEM

    deltas = Deltas()
    request = _request(system=SYSTEM, tools=[], messages=[Message.user("Your task (t1): do it")])
    response = await model.complete(request, on_text=deltas)
    assert "".join(deltas) == response.text == "first answer, written in a few words" and len(deltas) > 1


async def test_a_gulped_stream_pauses_only_after_an_event_it_waited_for() -> None:
    """After an event the reader had to wait for, `gulped` waits one interval (the next events gather
    in the buffer meanwhile); events already read come at once; interval 0 passes them through."""

    async def source() -> AsyncIterator[str]:
        await asyncio.sleep(0.02)  # a socket read that waited
        yield "a"
        yield "b"  # already buffered
        yield "c"

    for interval, pause in ((0.3, True), (0.0, False)):
        loop = asyncio.get_running_loop()
        start = loop.time()
        at: dict[str, float] = {}
        async for item in gulped(source(), interval):
            at[item] = loop.time() - start
        assert list(at) == ["a", "b", "c"]
        if pause:
            assert at["b"] - at["a"] >= 0.29  # paused after the waited-for "a"
        else:
            assert at["b"] - at["a"] < 0.1
        assert at["c"] - at["b"] < 0.1  # no pause after the buffered "b"
