"""Idle HTTP connections to a model's API are kept for `TASKLOOM_HTTP_KEEPALIVE` seconds (default 30),
not the SDKs' 5: a call after a pause shorter than that reuses its connection, a call after a longer
one opens a new one. Measured at the fake servers, which count the TCP connections they accept."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from llm import ModelRequest
from llm.anthropic import AnthropicModel
from llm.errors import ModelConfigError
from llm.keepalive import DEFAULT_KEEPALIVE, KEEPALIVE_ENV, connection_limits, keepalive_seconds
from llm.openai import OpenAIModel
from llm.port import ModelPort
from llm.testing import FakeAnthropicServer, FakeOpenAIServer, openai_text_reply, text_reply
from llm.types import Message

# Short enough for a test, with margins a loaded machine keeps: a pause of a fifth of it reuses, a
# pause of one and a half times it does not.
KEEP = 1.0


def _request() -> ModelRequest:
    return ModelRequest(system="s", max_tokens=64, messages=[Message.user("hi")])


async def _connections_after_pauses(model: ModelPort, server: FakeAnthropicServer | FakeOpenAIServer) -> list[int]:
    """Connections accepted after a first call, after one a short pause later, after one past the keep-alive."""
    seen = []
    try:
        for pause in (0.0, KEEP / 5, KEEP * 1.5):
            await asyncio.sleep(pause)
            await model.complete(_request())
            seen.append(server.connections)
    finally:
        await model.aclose()  # type: ignore[attr-defined]
    return seen


def test_the_default_is_thirty_seconds_and_the_variable_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEPALIVE_ENV, raising=False)
    assert keepalive_seconds() == DEFAULT_KEEPALIVE == 30.0
    assert connection_limits(anthropic.DEFAULT_CONNECTION_LIMITS).keepalive_expiry == 30.0
    monkeypatch.setenv(KEEPALIVE_ENV, " 90.5 ")
    limits = connection_limits(openai.DEFAULT_CONNECTION_LIMITS)
    assert limits.keepalive_expiry == 90.5
    # The pool's sizes stay the SDK's own.
    sdk = openai.DEFAULT_CONNECTION_LIMITS
    assert limits.max_connections == sdk.max_connections
    assert limits.max_keepalive_connections == sdk.max_keepalive_connections
    monkeypatch.setenv(KEEPALIVE_ENV, "")
    assert keepalive_seconds() == 30.0  # empty: unset


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf", "3601", "5s"])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(KEEPALIVE_ENV, raw)
    with pytest.raises(ModelConfigError, match=f"TASKLOOM_HTTP_KEEPALIVE={raw!r} is not a keep-alive time"):
        keepalive_seconds()
    # Where a model is built, before anything is sent.
    with pytest.raises(ModelConfigError, match="TASKLOOM_HTTP_KEEPALIVE"):
        AnthropicModel("claude-test", api_key="sk-ant-test", base_url="http://127.0.0.1:9")
    with pytest.raises(ModelConfigError, match="TASKLOOM_HTTP_KEEPALIVE"):
        OpenAIModel("gpt-test", api_key="sk-test", base_url="http://127.0.0.1:9/v1")


@pytest.mark.parametrize("transport", ["aiohttp", "httpx"])
async def test_anthropic_keeps_an_idle_connection_for_the_keepalive(
    server: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setenv(KEEPALIVE_ENV, str(KEEP))
    server.enqueue(*(text_reply(f"reply {i}") for i in range(3)))
    model = AnthropicModel("claude-test", api_key="sk-ant-test", base_url=server.base_url, http_client=transport)
    assert await _connections_after_pauses(model, server) == [1, 1, 2]


async def test_openai_keeps_an_idle_connection_for_the_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEPALIVE_ENV, str(KEEP))
    with FakeOpenAIServer() as server:
        server.enqueue(*(openai_text_reply(f"reply {i}") for i in range(3)))
        model = OpenAIModel("gpt-test", api_key="sk-test", base_url=server.base_url)
        assert await _connections_after_pauses(model, server) == [1, 1, 2]


@pytest.mark.parametrize("provider", ["anthropic/aiohttp", "anthropic/httpx", "openai"])
async def test_a_connection_the_server_closed_while_idle_is_not_reused(
    monkeypatch: pytest.MonkeyPatch, provider: str
) -> None:
    """An endpoint that closes idle connections sooner than our keep-alive (a load balancer's idle
    timeout): the next call goes out on a new connection and succeeds, with nothing lost."""
    monkeypatch.delenv(KEEPALIVE_ENV, raising=False)  # 30 s: far longer than the server keeps it
    server: FakeAnthropicServer | FakeOpenAIServer
    model: ModelPort
    if provider == "openai":
        server = FakeOpenAIServer()
        server.enqueue(*(openai_text_reply(f"reply {i}") for i in range(2)))
    else:
        server = FakeAnthropicServer()
        server.enqueue(*(text_reply(f"reply {i}") for i in range(2)))
    server.idle_timeout = 0.2
    with server:
        if provider == "openai":
            model = OpenAIModel("gpt-test", api_key="sk-test", base_url=server.base_url)
        else:
            transport = provider.split("/")[1]
            model = AnthropicModel(
                "claude-test", api_key="sk-ant-test", base_url=server.base_url, http_client=transport
            )
        try:
            first = await model.complete(_request())
            await asyncio.sleep(0.6)  # the server has closed the connection meanwhile
            second = await model.complete(_request())
        finally:
            await model.aclose()  # type: ignore[attr-defined]
        assert (first.text, second.text) == ("reply 0", "reply 1")
        assert server.connections == 2
        assert len(server.requests) == 2
