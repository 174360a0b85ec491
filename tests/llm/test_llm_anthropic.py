"""The Anthropic adapter, driven through the real SDK against the fake Messages API server."""

from __future__ import annotations

import socket
import time

import anthropic
import pytest

from llm import (
    Message,
    ModelConfigError,
    ModelConnectionError,
    ModelRequest,
    ModelTimeoutError,
    RetryableModelError,
    TerminalModelError,
    TextBlock,
    ToolChoice,
    ToolDef,
    ToolNameCollisionError,
    ToolPairingError,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from llm.anthropic import AnthropicModel, build_params, count_cache_markers, tool_name_map
from llm.pairing import check_tool_pairing
from llm.testing import (
    Failure,
    FakeAnthropicServer,
    Reply,
    malformed,
    overloaded,
    rate_limited,
    request_from_wire,
    server_error,
    text_reply,
    tool_reply,
)

TEST_KEY = "sk-ant-test-not-a-real-key"

LOOKUP = ToolDef(
    name="svc.order.lookup",
    description="Look up an order",
    input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)
POLICY = ToolDef(name="refund_policy", description="The refund policy")


def _request(*messages: Message, **kwargs: object) -> ModelRequest:
    history = list(messages) or [Message.user("Can order A100 be refunded?")]
    fields: dict[str, object] = {"system": "You are a support agent.", "max_tokens": 512, "tools": [LOOKUP, POLICY]}
    return ModelRequest.model_validate({**fields, "messages": history, **kwargs})


def _model(server: FakeAnthropicServer, **kwargs: object) -> AnthropicModel:
    return AnthropicModel("claude-test", api_key=TEST_KEY, base_url=server.base_url, **kwargs)  # type: ignore[arg-type]


async def test_parallel_tool_calls_round_trip(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """Two parallel tool_use -> their tool_results -> end_turn, with names mapped both ways and usage reported."""
    server.enqueue(
        tool_reply([("svc_order_lookup", {"order_id": "A100"}), ("refund_policy", {})], text="Checking."),
        text_reply("A100 can be refunded."),
    )
    request = _request(metadata={"goal_id": "g-1"})
    first = await model.complete(request)
    assert first.stop_reason == "tool_call"
    assert [(t.name, t.input) for t in first.tool_uses] == [
        ("svc.order.lookup", {"order_id": "A100"}),
        ("refund_policy", {}),
    ]
    assert first.text == "Checking."

    results = Message(role="user", content=[ToolResultBlock(tool_use_id=t.id, content="{}") for t in first.tool_uses])
    final = await model.complete(
        request.model_copy(update={"messages": [*request.messages, first.as_message(), results]})
    )
    assert final.stop_reason == "stop"
    assert final.text == "A100 can be refunded."
    assert final.request_id == server.requests[-1].request_id
    assert first.usage + final.usage == server.billed

    wire = server.requests[-1]
    assert wire.headers["authorization"] == f"Bearer {TEST_KEY}"
    assert "metadata" not in wire.body
    assert wire.tool_names == ["svc_order_lookup", "refund_policy"]
    assert wire.messages[1]["content"][1]["name"] == "svc_order_lookup"
    user_turn = wire.messages[2]["content"]
    assert [b["type"] for b in user_turn] == ["tool_result", "tool_result"]
    assert [b["tool_use_id"] for b in user_turn] == [b["id"] for b in wire.messages[1]["content"][1:]]
    check_tool_pairing(request_from_wire(wire.body).messages)


async def test_cache_markers_on_tools_system_and_latest_user_turn(
    server: FakeAnthropicServer, model: AnthropicModel
) -> None:
    """Cache breakpoints sit on the last tool, the system block and the latest user turn's last block (<= 4)."""
    server.respond_with(lambda _: text_reply("ok"))
    call = Message(role="assistant", content=[ToolUseBlock(id="t1", name="refund_policy")])
    answered = Message(
        role="user", content=[ToolResultBlock(tool_use_id="t1", content="30 days"), TextBlock(text="go")]
    )
    await model.complete(_request(Message.user("first"), call, answered))
    body = server.requests[-1].body
    assert count_cache_markers(body) == 3
    assert "cache_control" in body["tools"][-1] and "cache_control" not in body["tools"][0]
    assert "cache_control" in body["system"][-1]
    assert "cache_control" in body["messages"][-1]["content"][-1]
    assert count_cache_markers(body["messages"][:-1]) == 0

    await model.complete(_request(cache=False))
    assert count_cache_markers(server.requests[-1].body) == 0


async def test_cached_prefix_is_billed_as_cache_read(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """A repeated prefix comes back as cache reads in the usage, which the adapter reports separately."""
    server.respond_with(lambda _: text_reply("ok"))
    first = await model.complete(_request())
    second = await model.complete(_request())
    assert first.usage.cache_read_tokens == 0 and first.usage.cache_write_tokens > 0
    assert second.usage.cache_read_tokens == first.usage.cache_write_tokens
    assert second.usage.cache_write_tokens == 0


async def test_forced_dotted_tool_round_trips(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """Forcing `svc.order.lookup` sends its mapped name in tool_choice and maps the call back."""
    server.enqueue(tool_reply([("svc_order_lookup", {"order_id": "A1"})]))
    response = await model.complete(
        _request(tool_choice=ToolChoice(type="tool", name="svc.order.lookup", disable_parallel=True))
    )
    assert response.tool_uses[0].name == "svc.order.lookup"
    assert server.requests[-1].body["tool_choice"] == {
        "type": "tool",
        "name": "svc_order_lookup",
        "disable_parallel_tool_use": True,
    }


async def test_colliding_tool_names_fail_before_sending(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """`a.b` and `a_b` cannot both be offered: a ToolNameCollisionError naming both, and no request."""
    request = _request(tools=[ToolDef(name="a.b"), ToolDef(name="a_b")])
    with pytest.raises(ToolNameCollisionError, match=r"a\.b.*a_b"):
        await model.complete(request)
    assert server.requests == []


async def test_broken_pairing_fails_before_sending(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """A history whose tool_use has no tool_result is refused locally with the id named."""
    call = Message(role="assistant", content=[ToolUseBlock(id="t9", name="refund_policy")])
    with pytest.raises(ToolPairingError, match="t9"):
        await model.complete(_request(Message.user("x"), call, Message.user("no result")))
    assert server.requests == []


async def test_429_retry_after_is_honoured_by_the_sdk(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """A 429 with `retry-after: 1` is retried by the SDK about a second later, then succeeds."""
    server.enqueue(rate_limited(retry_after=1), text_reply("ok"))
    started = time.monotonic()
    response = await model.complete(_request())
    assert response.text == "ok"
    first, second = server.requests
    assert second.at - first.at >= 0.9
    assert time.monotonic() - started >= 0.9
    assert second.headers["x-stainless-retry-count"] == "1"


async def test_529_exhausts_sdk_retries_into_retryable_error(server: FakeAnthropicServer) -> None:
    """Three 529s with max_retries=2: three attempts, then RetryableModelError(529, last request id)."""
    server.enqueue(overloaded(), overloaded(), overloaded())
    model = _model(server, max_retries=2)
    with pytest.raises(RetryableModelError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert len(server.requests) == 3
    assert caught.value.status == 529
    assert caught.value.request_id == server.requests[-1].request_id
    assert caught.value.retryable and not caught.value.maybe_spent
    assert server.billed == Usage()


@pytest.mark.parametrize(
    ("failure", "error", "attempts"),
    [
        (Failure(status=400), TerminalModelError, 1),
        (Failure(status=401), TerminalModelError, 1),
        (server_error(500, should_retry=False), TerminalModelError, 1),
        (server_error(503), RetryableModelError, 2),
        (Failure(status=409), RetryableModelError, 2),
    ],
)
async def test_status_mapping(
    server: FakeAnthropicServer, failure: Failure, error: type[Exception], attempts: int
) -> None:
    """4xx are terminal and not retried; 409/5xx are retried by the SDK then retryable; x-should-retry wins."""
    server.respond_with(lambda _: failure)
    model = _model(server, max_retries=1)
    with pytest.raises(error) as caught:
        await model.complete(_request())
    await model.aclose()
    assert len(server.requests) == attempts
    assert getattr(caught.value, "status", None) == failure.status


async def test_read_timeout_maps_to_timeout_error(server: FakeAnthropicServer) -> None:
    """No answer within `timeout` -> ModelTimeoutError, counted as spent (the fake server billed it)."""
    server.enqueue(Reply(content=[{"type": "text", "text": "late"}], delay=3))
    model = _model(server, max_retries=0, timeout=0.3)
    with pytest.raises(ModelTimeoutError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.maybe_spent
    assert server.billed.total > 0


TRANSPORTS = ("aiohttp", "httpx")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_dropped_connection_counts_as_maybe_spent(server: FakeAnthropicServer, transport: str) -> None:
    """A connection closed after the request was sent is an unknown outcome: ModelTimeoutError. Under
    aiohttp the transport calls it a ConnectError too; the aiohttp error under it says it was sent."""
    server.enqueue(Failure(disconnect=True))
    model = _model(server, max_retries=0, http_client=transport)
    with pytest.raises(ModelTimeoutError, match="after the request was sent"):
        await model.complete(_request())
    await model.aclose()


async def test_earlier_timed_out_attempt_marks_final_error_as_spent(server: FakeAnthropicServer) -> None:
    """If any attempt may have been billed, the final error says so even when the last one was a 529."""
    server.enqueue(Reply(content=[{"type": "text", "text": "late"}], delay=3), overloaded())
    model = _model(server, max_retries=1, timeout=0.3)
    with pytest.raises(RetryableModelError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.status == 529 and caught.value.maybe_spent


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_connection_refused_maps_to_connection_error(transport: str) -> None:
    """Nothing listening -> ModelConnectionError, not spent (the ledger may release its reservation)."""
    model = AnthropicModel(
        "claude-test",
        api_key=TEST_KEY,
        base_url=f"http://127.0.0.1:{_closed_port()}",
        max_retries=1,
        http_client=transport,
    )
    with pytest.raises(ModelConnectionError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert not caught.value.maybe_spent and caught.value.retryable


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_either_transport_completes_a_call(server: FakeAnthropicServer, transport: str) -> None:
    """Both HTTP transports under the SDK carry a call and its usage (aiohttp is the default)."""
    server.enqueue(text_reply("over aiohttp or httpx"))
    model = _model(server, http_client=transport)
    result = await model.complete(_request())
    await model.aclose()
    assert result.text == "over aiohttp or httpx" and result.usage.output_tokens > 0


def test_unknown_http_client_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKLOOM_HTTP_CLIENT", "requests")
    with pytest.raises(ModelConfigError, match="TASKLOOM_HTTP_CLIENT='requests'"):
        AnthropicModel("claude-test", api_key=TEST_KEY, base_url="http://127.0.0.1:9")
    monkeypatch.setenv("TASKLOOM_HTTP_CLIENT", "httpx")
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url="http://127.0.0.1:9")
    assert not isinstance(model._client._client, anthropic.DefaultAioHttpClient)
    monkeypatch.delenv("TASKLOOM_HTTP_CLIENT")
    model = AnthropicModel("claude-test", api_key=TEST_KEY, base_url="http://127.0.0.1:9")
    assert isinstance(model._client._client, anthropic.DefaultAioHttpClient)


async def test_malformed_body_is_an_error_not_a_crash(server: FakeAnthropicServer, model: AnthropicModel) -> None:
    """A 200 whose body is not JSON surfaces as a ModelError subclass (counted as spent), never a raw SDK error."""
    server.respond_with(lambda _: malformed())
    with pytest.raises((RetryableModelError, TerminalModelError)) as caught:
        await model.complete(_request())
    assert caught.value.maybe_spent


async def test_a_reply_is_validated_and_matches_the_sdks_own_parse(
    server: FakeAnthropicServer, model: AnthropicModel
) -> None:
    """The reply is read raw and validated in one pass (not the SDK's field-by-field parse): the
    response is the one the SDK's own `Message` gives, tool call, usage and request id included."""
    reply = tool_reply([("svc.order.lookup", {"order_id": "A100"})], text="Looking it up.")
    server.enqueue(reply, reply)
    request = _request()
    ours = await model.complete(request)
    wire = await model._client.messages.create(**build_params(request, "claude-test", tool_name_map(request)))
    assert [type(b) for b in ours.content] == [TextBlock, ToolUseBlock]
    assert isinstance(ours.content[1], ToolUseBlock)
    assert ours.content[1].name == "svc.order.lookup" and ours.content[1].input == {"order_id": "A100"}
    assert ours.usage.input_tokens == wire.usage.input_tokens > 0
    assert ours.usage.output_tokens == wire.usage.output_tokens > 0
    assert ours.request_id == server.requests[0].request_id


async def test_a_block_type_newer_than_the_sdk_is_skipped_not_an_error(server: FakeAnthropicServer) -> None:
    """A reply with a content block this SDK's types do not know still gives its other blocks (the
    SDK's lenient parse, as before), rather than failing the call as unparseable."""
    server.enqueue(Reply(content=[{"type": "hologram", "frames": 3}, {"type": "text", "text": "Refundable."}]))
    model = _model(server)  # as deployed: without the SDK's strict validation, which tests turn on
    response = await model.complete(_request())
    await model.aclose()
    assert response.content == [TextBlock(text="Refundable.")]


def test_missing_key_names_the_variable() -> None:
    """No key argument and no ANTHROPIC_API_KEY -> ModelConfigError at construction, naming the variable."""
    with pytest.raises(ModelConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicModel("claude-test")


async def test_key_and_base_url_from_environment(server: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL are used when no arguments are given."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-env")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.base_url)
    server.enqueue(text_reply("env"))
    model = AnthropicModel("claude-test")
    assert (await model.complete(_request())).text == "env"
    await model.aclose()
    assert server.requests[0].headers["authorization"] == "Bearer sk-ant-from-env"


async def test_raw_sdk_strict_validation_accepts_fake_replies(server: FakeAnthropicServer) -> None:
    """The fake server's JSON passes the SDK's strict response validation, and count_tokens answers."""
    server.enqueue(tool_reply([("lookup", {"order_id": "A1"})], text="hi"))
    client = anthropic.AsyncAnthropic(api_key=TEST_KEY, base_url=server.base_url, _strict_response_validation=True)
    message = await client.messages.create(
        model="claude-test",
        max_tokens=50,
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"name": "lookup", "input_schema": {"type": "object"}}],
    )
    assert message.stop_reason == "tool_use"
    assert message.content[1].type == "tool_use" and message.content[1].input == {"order_id": "A1"}
    assert message.usage.output_tokens > 0
    count = await client.messages.count_tokens(model="claude-test", messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0
    await client.close()
