"""The OpenAI-compatible adapter: its mapping tables, and the adapter driven through the real openai SDK
against the fake Chat Completions server (strict response validation on unless a quirk needs it off)."""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import time
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from llm import (
    Message,
    ModelConfigError,
    ModelConnectionError,
    ModelRequest,
    ModelResponse,
    ModelTimeoutError,
    RetryableModelError,
    TerminalModelError,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDef,
    ToolNameCollisionError,
    ToolPairingError,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from llm.demo import DemoModel
from llm.errors import ContextLengthError
from llm.forced import FormSpec, ask_forced
from llm.openai import (
    OpenAIModel,
    assemble_stream,
    build_params,
    is_context_length,
    parse_arguments,
    prompt_cache_key,
    stop_reason,
    synthetic_call_id,
    to_response,
    tool_name_map,
    usage_from_wire,
)
from llm.pairing import check_tool_pairing
from llm.testing import (
    Failure,
    FakeOpenAIServer,
    OpenAIReply,
    ToolCall,
    context_length_exceeded,
    openai_error_body,
    openai_rate_limited,
    openai_request_from_wire,
    openai_responder_from_model,
    openai_text_reply,
    openai_tool_reply,
)

TEST_KEY = "sk-test-not-a-real-key"

LOOKUP = ToolDef(
    name="svc.order.lookup",
    description="Look up an order",
    input_schema={"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)
POLICY = ToolDef(name="refund_policy", description="The refund policy")


def _request(*messages: Message, **kwargs: Any) -> ModelRequest:
    history = list(messages) or [Message.user("Can order A100 be refunded?")]
    fields: dict[str, Any] = {"system": "You are a support agent.", "max_tokens": 512, "tools": [LOOKUP, POLICY]}
    return ModelRequest.model_validate({**fields, "messages": history, **kwargs})


def _model(server: FakeOpenAIServer, **kwargs: Any) -> OpenAIModel:
    kwargs.setdefault("strict_validation", True)
    return OpenAIModel("gpt-test", api_key=TEST_KEY, base_url=server.base_url, **kwargs)


@pytest.fixture
def server() -> Any:
    with FakeOpenAIServer() as fake:
        yield fake


def _completion(message: dict[str, Any], finish: str | None = "stop", usage: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return body


# -- the mapping tables (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "tools", "wire_choice", "parallel"),
    [
        (None, True, None, None),
        (ToolChoice(type="auto"), True, "auto", None),
        (ToolChoice(type="any"), True, "required", None),
        (ToolChoice(type="none"), True, "none", None),
        (
            ToolChoice.force("svc.order.lookup"),
            True,
            {"type": "function", "function": {"name": "svc_order_lookup"}},
            None,
        ),
        (ToolChoice(type="auto", disable_parallel=True), True, "auto", False),
        (ToolChoice(type="any", disable_parallel=True), True, "required", False),
        (ToolChoice(type="none", disable_parallel=True), False, "none", None),
    ],
)
def test_tool_choice_table(choice: ToolChoice | None, tools: bool, wire_choice: Any, parallel: bool | None) -> None:
    """tool_choice auto/any/tool/none -> "auto"/"required"/{function}/"none"; parallel_tool_calls only with tools."""
    request = _request(tool_choice=choice, tools=[LOOKUP, POLICY] if tools else [])
    params = build_params(request, "m", tool_name_map(request))
    assert params.get("tool_choice") == wire_choice
    assert params.get("parallel_tool_calls") == parallel
    assert ("tools" in params) == tools


def test_tools_and_history_mapping() -> None:
    """System first; tools as functions; assistant text + calls in one message; one tool message per
    result (errors prefixed); thinking dropped; a user turn's text after its tool results."""
    call = ToolUseBlock(id="c1", name="svc.order.lookup", input={"order_id": "A1"})
    broken = ToolUseBlock(id="c2", name="refund_policy", invalid_input="{oops")
    request = _request(
        Message.user("hi"),
        Message(
            role="assistant",
            content=[ThinkingBlock(thinking="hm", signature="s"), TextBlock(text="Let me see."), call, broken],
        ),
        Message(
            role="user",
            content=[
                ToolResultBlock(tool_use_id="c1", content='{"status": "delivered"}'),
                ToolResultBlock(tool_use_id="c2", content="bad arguments", is_error=True),
                TextBlock(text="and?"),
            ],
        ),
        Message(role="assistant", content=[ThinkingBlock(thinking="only thinking", signature="s")]),
        Message.user("go on"),
        stop_sequences=["END"],
    )
    params = build_params(request, "gpt-x", tool_name_map(request))
    assert params["model"] == "gpt-x" and params["max_completion_tokens"] == 512 and params["stop"] == ["END"]
    assert params["tools"][0] == {
        "type": "function",
        "function": {"name": "svc_order_lookup", "description": "Look up an order", "parameters": LOOKUP.input_schema},
    }
    assert params["messages"] == [
        {"role": "system", "content": "You are a support agent."},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "svc_order_lookup", "arguments": '{"order_id": "A1"}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "refund_policy", "arguments": "{oops"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "delivered"}'},
        {"role": "tool", "tool_call_id": "c2", "content": "ERROR: bad arguments"},
        {"role": "user", "content": "and?"},
        {"role": "user", "content": "go on"},
    ]
    assert "metadata" not in params and "prompt_cache_key" not in params


def test_gateway_error_observation_is_not_prefixed_twice() -> None:
    """A failed result that already reads `ERROR: ...` (the tool gateway's) is sent unchanged."""
    request = _request(
        Message.user("hi"),
        Message(role="assistant", content=[ToolUseBlock(id="c1", name="refund_policy")]),
        Message(role="user", content=[ToolResultBlock(tool_use_id="c1", content="ERROR: timed out", is_error=True)]),
    )
    assert build_params(request, "m", tool_name_map(request))["messages"][-1]["content"] == "ERROR: timed out"


def test_max_tokens_param_for_older_servers() -> None:
    """`max_tokens_param="max_tokens"` sends the older field name instead of max_completion_tokens."""
    request = _request()
    params = build_params(request, "m", tool_name_map(request), max_tokens_param="max_tokens")
    assert params["max_tokens"] == 512 and "max_completion_tokens" not in params


def test_prompt_cache_key_is_opt_in_and_a_hash_of_the_goal() -> None:
    """prompt_cache_key goes out only when enabled and the request names a goal; it is stable and not the id."""
    request = _request(metadata={"goal_id": "goal-42"})
    names = tool_name_map(request)
    assert "prompt_cache_key" not in build_params(request, "m", names)
    key = build_params(request, "m", names, cache_key=True)["prompt_cache_key"]
    assert key == prompt_cache_key("goal-42") and "goal-42" not in key and len(key) <= 64
    assert "prompt_cache_key" not in build_params(_request(), "m", names, cache_key=True)
    assert prompt_cache_key("goal-42") != prompt_cache_key("goal-43")


@pytest.mark.parametrize(
    ("finish", "has_calls", "output", "expected"),
    [
        ("stop", False, 5, "stop"),
        ("tool_calls", True, 5, "tool_call"),
        ("function_call", True, 5, "tool_call"),
        ("length", False, 100, "length"),
        ("length", False, 7, "context_length"),
        ("content_filter", False, 5, "content_filter"),
        (None, True, 5, "tool_call"),
        (None, False, 5, "stop"),
        ("eos_token", False, 5, "stop"),
        ("stop", True, 5, "stop"),
        ("length", True, 7, "length"),
    ],
)
def test_finish_reason_table(finish: str | None, has_calls: bool, output: int, expected: str) -> None:
    """Finish reasons onto StopReason; unknown/None by the calls present; `length` short of max_tokens: context."""
    assert stop_reason(finish, has_calls, Usage(output_tokens=output), max_tokens=100) == expected


def test_length_without_usage_stays_length() -> None:
    """Without usage, a `length` finish cannot be told apart from max_tokens: it stays `length`."""
    assert stop_reason("length", False, None, max_tokens=100) == "length"


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),
        ({"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}, Usage(input_tokens=100, output_tokens=7)),
        (
            {"prompt_tokens": 100, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}},
            Usage(input_tokens=36, output_tokens=7, cache_read_tokens=64),
        ),
        (
            {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": None},
            Usage(input_tokens=10, output_tokens=1),
        ),
    ],
)
def test_usage_table(usage: dict[str, Any] | None, expected: Usage | None) -> None:
    """cached_tokens -> cache_read; input = prompt - cached; output = completion; cache_write = 0."""
    assert usage_from_wire(usage) == expected


@pytest.mark.parametrize(
    ("arguments", "no_parameters", "expected"),
    [
        ('{"order_id": "A1"}', False, ({"order_id": "A1"}, None)),
        (None, False, ({}, "null")),
        ("", True, ({}, None)),
        ("", False, ({}, "")),
        ("{broken", False, ({}, "{broken")),
        ("[1, 2]", False, ({}, "[1, 2]")),
        ('"text"', False, ({}, '"text"')),
        ("null", False, ({}, "null")),
        ({"order_id": "A1"}, False, ({"order_id": "A1"}, None)),
    ],
)
def test_arguments_table(arguments: Any, no_parameters: bool, expected: tuple[dict[str, Any], str | None]) -> None:
    """Arguments that are null, empty, broken or not an object give input {} and the raw text, never a crash."""
    assert parse_arguments(arguments, no_parameters=no_parameters) == expected


def test_missing_tool_call_ids_get_stable_ids() -> None:
    """A call without an id (or with "") gets `call_` + a hash of index, name and arguments: the same each time."""
    names = tool_name_map(_request())
    calls = [
        {"type": "function", "function": {"name": "refund_policy", "arguments": "{}"}},
        {"id": "", "type": "function", "function": {"name": "refund_policy", "arguments": "{}"}},
        {"id": "call_real", "type": "function", "function": {"name": "svc_order_lookup", "arguments": "{}"}},
    ]
    body = _completion({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls")
    first = to_response(body, names, "m")
    again = to_response(json.loads(json.dumps(body)), names, "m")
    ids = [u.id for u in first.tool_uses]
    assert ids == [u.id for u in again.tool_uses]
    assert ids[0] == synthetic_call_id(0, "refund_policy", "{}") and ids[0].startswith("call_")
    assert len(set(ids)) == 3 and ids[2] == "call_real"
    assert first.tool_uses[2].name == "svc.order.lookup"


def test_refusal_is_a_content_filter_stop() -> None:
    """A message carrying OpenAI's `refusal` (and no content) -> content_filter with the refusal as its text."""
    body = _completion({"role": "assistant", "content": None, "refusal": "I can't help with that."})
    response = to_response(body, tool_name_map(_request()), "m")
    assert response.stop_reason == "content_filter" and response.text == "I can't help with that."


def test_reused_tool_call_ids_are_replaced() -> None:
    """An id the history already holds, or repeated within the reply, is replaced by a synthetic one."""
    history = _request(
        Message.user("hi"),
        Message(role="assistant", content=[ToolUseBlock(id="call_0", name="refund_policy")]),
        Message(role="user", content=[ToolResultBlock(tool_use_id="call_0", content="{}")]),
    )
    calls = [
        {"id": "call_0", "type": "function", "function": {"name": "refund_policy", "arguments": "{}"}},
        {"id": "call_1", "type": "function", "function": {"name": "refund_policy", "arguments": "{}"}},
        {"id": "call_1", "type": "function", "function": {"name": "svc_order_lookup", "arguments": "{}"}},
    ]
    body = _completion({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls")
    ids = [u.id for u in to_response(body, tool_name_map(history), "m", request=history).tool_uses]
    assert ids[0] == synthetic_call_id(0, "refund_policy", "{}", turn=3) and ids[1] == "call_1"
    assert ids[2].startswith("call_") and len(set(ids)) == 3
    check_tool_pairing(
        [*history.messages, Message(role="assistant", content=[ToolUseBlock(id=i, name="x") for i in ids])],
        allow_pending=True,
    )


def test_reply_without_usage_is_flagged() -> None:
    """No `usage` object -> usage zero and usage_reported False (the ledger charges the worst case)."""
    response = to_response(_completion({"role": "assistant", "content": "hi"}), tool_name_map(_request()), "m")
    assert response.usage == Usage() and not response.usage_reported
    assert "usage_reported" in response.model_dump()


def test_stream_deltas_are_grouped_by_index_not_id() -> None:
    """Interleaved deltas of two calls, ids only on the first (or repeated, or missing), assemble by index."""

    def chunk(**delta: Any) -> dict[str, Any]:
        return {"id": "x", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    chunks = [
        chunk(role="assistant", content=""),
        chunk(content="Look"),
        chunk(tool_calls=[{"index": 0, "id": "call_a", "function": {"name": "svc_order_lookup", "arguments": ""}}]),
        chunk(tool_calls=[{"index": 1, "function": {"name": "refund_policy", "arguments": ""}}]),
        chunk(tool_calls=[{"index": 0, "id": "call_a", "function": {"arguments": '{"order_'}}]),
        chunk(tool_calls=[{"index": 1, "id": "call_other", "function": {"arguments": "{}"}}]),
        chunk(tool_calls=[{"index": 0, "function": {"arguments": 'id": "A1"}'}}]),
        {"id": "x", "model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"id": "x", "model": "m", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
    ]
    completion = assemble_stream(chunks)
    response = to_response(completion, tool_name_map(_request()), "m")
    assert response.text == "Look" and response.stop_reason == "tool_call"
    assert [(u.id, u.name, u.input) for u in response.tool_uses] == [
        ("call_a", "svc.order.lookup", {"order_id": "A1"}),
        ("call_other", "refund_policy", {}),
    ]
    assert response.usage == Usage(input_tokens=9, output_tokens=4)


@pytest.mark.parametrize(
    ("code", "message", "expected"),
    [
        ("context_length_exceeded", "anything", True),
        (None, "This model's maximum context length is 8192 tokens.", True),
        (None, "the request exceeds the available context size, try increasing it", True),
        (None, "Invalid 'messages[0].role'", False),
        ("invalid_api_key", "Incorrect API key provided", False),
    ],
)
def test_context_length_detection(code: str | None, message: str, expected: bool) -> None:
    """A 4xx is a context overflow by OpenAI's code or, for servers without one, by its message."""
    assert is_context_length(code, message) is expected


def test_request_from_wire_inverts_build_params() -> None:
    """openai_request_from_wire(build_params(r)) is r with wire tool names (ids, inputs, order, choice kept)."""
    call = ToolUseBlock(id="toolu_1", name="svc.order.lookup", input={"order_id": "A1"})
    request = _request(
        Message.user("hi"),
        Message(
            role="assistant",
            content=[TextBlock(text="Checking."), call, ToolUseBlock(id="toolu_2", name="refund_policy")],
        ),
        Message(
            role="user",
            content=[
                ToolResultBlock(tool_use_id="toolu_1", content="{}"),
                ToolResultBlock(tool_use_id="toolu_2", content="ERROR: nope", is_error=True),
                TextBlock(text="so?"),
            ],
        ),
        tool_choice=ToolChoice(type="tool", name="svc.order.lookup", disable_parallel=True),
        stop_sequences=["END"],
    )
    back = openai_request_from_wire(build_params(request, "m", tool_name_map(request)))
    expected = json.loads(request.model_dump_json().replace("svc.order.lookup", "svc_order_lookup"))
    assert json.loads(back.model_dump_json()) == expected


# -- through the SDK, against the fake server --------------------------------------------------------


async def test_text_reply(server: FakeOpenAIServer) -> None:
    """A text answer comes back as a TextBlock with `stop`, the request id from x-request-id, usage counted."""
    server.enqueue(openai_text_reply("hello"))
    model = _model(server)
    response = await model.complete(_request())
    await model.aclose()
    assert response.text == "hello" and response.stop_reason == "stop"
    assert response.request_id == server.requests[0].request_id
    assert response.usage == server.billed and response.usage.input_tokens > 0 and response.usage_reported
    assert response.rate_limit is None
    wire = server.requests[0]
    assert wire.path == "/v1/chat/completions" and wire.headers["authorization"] == f"Bearer {TEST_KEY}"
    assert wire.body["messages"][0] == {"role": "system", "content": "You are a support agent."}


@pytest.mark.parametrize("stream", [False, True])
async def test_parallel_tool_calls_round_trip(server: FakeOpenAIServer, stream: bool) -> None:
    """Two parallel calls -> two tool messages -> a text answer, names mapped both ways, ids kept, streamed or not."""
    server.enqueue(
        openai_tool_reply([("svc_order_lookup", {"order_id": "A100"}), ("refund_policy", {})], text="Checking."),
        openai_text_reply("A100 can be refunded."),
    )
    model = _model(server, stream=stream)
    request = _request()
    first = await model.complete(request)
    assert first.stop_reason == "tool_call" and first.text == "Checking."
    assert [(t.name, t.input) for t in first.tool_uses] == [
        ("svc.order.lookup", {"order_id": "A100"}),
        ("refund_policy", {}),
    ]
    results = Message(role="user", content=[ToolResultBlock(tool_use_id=t.id, content="{}") for t in first.tool_uses])
    final = await model.complete(
        request.model_copy(update={"messages": [*request.messages, first.as_message(), results]})
    )
    await model.aclose()
    assert final.text == "A100 can be refunded." and final.stop_reason == "stop"
    assert first.usage + final.usage == server.billed
    assert final.request_id == server.requests[-1].request_id
    wire = server.requests[-1]
    assert bool(wire.body.get("stream")) is stream
    if stream:
        assert wire.body["stream_options"] == {"include_usage": True}
    assert wire.tool_names == ["svc_order_lookup", "refund_policy"]
    sent_ids = [c["id"] for c in wire.messages[2]["tool_calls"]]
    assert sent_ids == [t.id for t in first.tool_uses]
    assert [m["tool_call_id"] for m in wire.messages[3:5]] == sent_ids


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (ToolChoice(type="any", disable_parallel=True), "required"),
        (ToolChoice(type="none"), "none"),
        (ToolChoice.force("svc.order.lookup"), {"type": "function", "function": {"name": "svc_order_lookup"}}),
    ],
)
async def test_tool_choice_on_the_wire(server: FakeOpenAIServer, choice: ToolChoice, expected: Any) -> None:
    """The adapter's tool_choice and parallel_tool_calls reach the server as OpenAI spells them."""
    server.enqueue(openai_tool_reply([("svc_order_lookup", {"order_id": "A1"})]))
    model = _model(server)
    response = await model.complete(_request(tool_choice=choice))
    await model.aclose()
    body = server.requests[0].body
    assert body["tool_choice"] == expected
    assert body.get("parallel_tool_calls") is (False if choice.disable_parallel else None)
    assert response.tool_uses[0].name == "svc.order.lookup"


async def test_cached_tokens_are_cache_reads() -> None:
    """A repeated prompt prefix is reported as cached_tokens, mapped to cache_read and out of input."""
    with FakeOpenAIServer(prompt_caching=True) as server:
        server.respond_with(lambda _: openai_text_reply("ok"))
        model = _model(server)
        first = await model.complete(_request())
        second = await model.complete(
            _request(
                Message.user("Can order A100 be refunded?"),
                Message(role="assistant", content=[TextBlock(text="ok")]),
                Message.user("and A101?"),
            )
        )
        await model.aclose()
    assert first.usage.cache_read_tokens == 0
    assert second.usage.cache_read_tokens >= first.usage.input_tokens - 8  # all but the per-request overhead
    assert second.usage.cache_write_tokens == 0
    assert first.usage + second.usage == server.billed


async def test_cache_floor_is_respected() -> None:
    """Below `cache_min_tokens` nothing is reported cached (OpenAI caches from 1024 tokens)."""
    with FakeOpenAIServer(prompt_caching=True, cache_min_tokens=1024) as server:
        server.respond_with(lambda _: openai_text_reply("ok"))
        model = _model(server)
        await model.complete(_request())
        second = await model.complete(_request())
        await model.aclose()
    assert second.usage.cache_read_tokens == 0


async def test_prompt_cache_key_reaches_the_server(server: FakeOpenAIServer) -> None:
    """With prompt_cache_key=True the hashed goal id is sent; extra_body is passed through."""
    server.enqueue(openai_text_reply("ok"))
    model = _model(server, prompt_cache_key=True, extra_body={"top_k": 20})
    await model.complete(_request(metadata={"goal_id": "g-7"}))
    await model.aclose()
    body = server.requests[0].body
    assert body["prompt_cache_key"] == prompt_cache_key("g-7") and body["top_k"] == 20


async def test_colliding_tool_names_fail_before_sending(server: FakeOpenAIServer) -> None:
    """Two tools mapping to one provider name -> ToolNameCollisionError, nothing sent."""
    model = _model(server)
    with pytest.raises(ToolNameCollisionError):
        await model.complete(_request(tools=[ToolDef(name="a.b"), ToolDef(name="a_b")]))
    await model.aclose()
    assert server.requests == []


async def test_broken_pairing_fails_before_sending(server: FakeOpenAIServer) -> None:
    """A history whose tool call has no result -> ToolPairingError before any request."""
    model = _model(server)
    call = Message(role="assistant", content=[ToolUseBlock(id="c1", name="refund_policy")])
    with pytest.raises(ToolPairingError):
        await model.complete(_request(Message.user("x"), call, Message.user("no result")))
    await model.aclose()
    assert server.requests == []


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ms", [False, True])
async def test_429_retry_after_is_honoured_by_the_sdk(server: FakeOpenAIServer, ms: bool) -> None:
    """A 429 with retry-after (or retry-after-ms) of 1 s is retried by the SDK a second later; rate_limit counts it."""
    server.enqueue(openai_rate_limited(1, ms=ms), openai_text_reply("ok"))
    model = _model(server)
    started = time.monotonic()
    response = await model.complete(_request())
    await model.aclose()
    assert response.text == "ok"
    first, second = server.requests
    assert second.at - first.at >= 0.9 and time.monotonic() - started >= 0.9
    assert second.headers["x-stainless-retry-count"] == "1"
    assert response.rate_limit is not None
    assert response.rate_limit.throttled == 1 and response.rate_limit.retry_after == pytest.approx(1.0)


async def test_rate_limit_headers_are_reported() -> None:
    """x-ratelimit-remaining-requests / -tokens are read into the response's rate_limit."""
    headers = {"x-ratelimit-remaining-requests": "41", "x-ratelimit-remaining-tokens": "9000"}
    with FakeOpenAIServer(headers=headers) as server:
        server.enqueue(openai_text_reply("ok"))
        model = _model(server)
        response = await model.complete(_request())
        await model.aclose()
    assert response.rate_limit is not None
    assert response.rate_limit.requests_remaining == 41 and response.rate_limit.input_tokens_remaining == 9000
    assert response.rate_limit.throttled == 0


async def test_429s_exhaust_retries_into_retryable_error(server: FakeOpenAIServer) -> None:
    """Three 429s with max_retries=2: three attempts, then RetryableModelError with retry_after and the request id."""
    server.enqueue(*[openai_rate_limited(0.05) for _ in range(3)])
    model = _model(server, max_retries=2)
    with pytest.raises(RetryableModelError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert len(server.requests) == 3
    assert caught.value.status == 429 and caught.value.retry_after == pytest.approx(0.05)
    assert caught.value.request_id == server.requests[-1].request_id
    assert not caught.value.maybe_spent and server.billed == Usage()


@pytest.mark.parametrize(
    ("failure", "error", "attempts"),
    [
        (Failure(status=400, body=openai_error_body(400, "bad")), TerminalModelError, 1),
        (Failure(status=401, body=openai_error_body(401, "Incorrect API key")), TerminalModelError, 1),
        (Failure(status=403), TerminalModelError, 1),
        (Failure(status=404), TerminalModelError, 1),
        (Failure(status=422), TerminalModelError, 1),
        (Failure(status=408), RetryableModelError, 2),
        (Failure(status=409), RetryableModelError, 2),
        (Failure(status=500), RetryableModelError, 2),
        (Failure(status=503), RetryableModelError, 2),
        (Failure(status=529), RetryableModelError, 2),
    ],
)
async def test_status_mapping(
    server: FakeOpenAIServer, failure: Failure, error: type[Exception], attempts: int
) -> None:
    """4xx are terminal and not retried; 408/409/5xx are retried by the SDK, then retryable."""
    server.respond_with(lambda _: failure)
    model = _model(server, max_retries=1)
    with pytest.raises(error) as caught:
        await model.complete(_request())
    await model.aclose()
    assert type(caught.value) is error
    assert len(server.requests) == attempts
    assert getattr(caught.value, "status", None) == failure.status
    assert getattr(caught.value, "request_id", None) == server.requests[-1].request_id


async def test_context_overflow_is_a_context_length_error(server: FakeOpenAIServer) -> None:
    """A 400 `context_length_exceeded` -> ContextLengthError (terminal), its message saying context length."""
    server.enqueue(context_length_exceeded())
    model = _model(server)
    with pytest.raises(ContextLengthError, match="context length") as caught:
        await model.complete(_request())
    await model.aclose()
    assert isinstance(caught.value, TerminalModelError) and not caught.value.retryable
    assert caught.value.status == 400 and len(server.requests) == 1


async def test_context_window_of_the_fake_server() -> None:
    """A prompt over the fake's context_window is refused as OpenAI refuses it, and mapped the same way."""
    with FakeOpenAIServer(context_window=50) as server:
        model = _model(server)
        with pytest.raises(ContextLengthError):
            await model.complete(_request())
        await model.aclose()
    assert server.billed == Usage()


async def test_context_overflow_message_without_code(server: FakeOpenAIServer) -> None:
    """A local server's 400 with only a message about the context size is a ContextLengthError too."""
    body = openai_error_body(400, "the request exceeds the available context size, try increasing it")
    server.enqueue(Failure(status=400, body=body))
    model = _model(server)
    with pytest.raises(ContextLengthError):
        await model.complete(_request())
    await model.aclose()


async def test_read_timeout_maps_to_timeout_error(server: FakeOpenAIServer) -> None:
    """No answer within `timeout` -> ModelTimeoutError, counted as spent (the fake billed it)."""
    server.enqueue(OpenAIReply(content="late", delay=3))
    model = _model(server, max_retries=0, timeout=0.3)
    with pytest.raises(ModelTimeoutError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.maybe_spent and server.billed.total > 0


async def test_dropped_connection_counts_as_maybe_spent(server: FakeOpenAIServer) -> None:
    """A connection closed after the request was sent is an unknown outcome: ModelTimeoutError."""
    server.enqueue(Failure(disconnect=True))
    model = _model(server, max_retries=0)
    with pytest.raises(ModelTimeoutError, match="after the request was sent"):
        await model.complete(_request())
    await model.aclose()


async def test_earlier_timed_out_attempt_marks_final_error_as_spent(server: FakeOpenAIServer) -> None:
    """If any attempt may have been billed, the final error says so even when the last one was a 503."""
    server.enqueue(OpenAIReply(content="late", delay=3), Failure(status=503))
    model = _model(server, max_retries=1, timeout=0.3)
    with pytest.raises(RetryableModelError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.status == 503 and caught.value.maybe_spent


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_connection_refused_maps_to_connection_error() -> None:
    """Nothing listening -> ModelConnectionError, not spent (the ledger may release its reservation)."""
    model = OpenAIModel("gpt-test", api_key=TEST_KEY, base_url=f"http://127.0.0.1:{_closed_port()}/v1", max_retries=1)
    with pytest.raises(ModelConnectionError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert not caught.value.maybe_spent and caught.value.retryable


@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_body_is_retryable_and_spent(server: FakeOpenAIServer, stream: bool) -> None:
    """A 200 whose body is not JSON -> RetryableModelError(maybe_spent=True), never a raw SDK error."""
    server.respond_with(lambda _: Failure(status=200, body='{"id": "chatcmpl-broken", "choices": ['))
    model = _model(server, stream=stream, max_retries=0)
    with pytest.raises(RetryableModelError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.maybe_spent


async def test_reply_without_choices_is_retryable_and_spent(server: FakeOpenAIServer) -> None:
    """A 200 with an empty `choices` list cannot be read: RetryableModelError, spent."""
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": []}
    server.enqueue(Failure(status=200, body=body))
    model = _model(server)
    with pytest.raises(RetryableModelError) as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.maybe_spent


async def test_cut_stream_is_a_timeout_and_spent(server: FakeOpenAIServer) -> None:
    """A stream whose connection closes before any finish_reason is a cut reply: ModelTimeoutError, spent."""
    server.enqueue(openai_tool_reply([("svc_order_lookup", {"order_id": "A100"})], text="Checking.", cut_after=3))
    model = _model(server, stream=True, max_retries=0)
    with pytest.raises(ModelTimeoutError, match="without a finish_reason") as caught:
        await model.complete(_request())
    await model.aclose()
    assert caught.value.maybe_spent and caught.value.request_id == server.requests[0].request_id


# -- local-server quirks ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_no_usage_is_flagged_not_guessed(stream: bool) -> None:
    """A server that sends no usage (nor usage chunk) -> usage_reported False, usage zero."""
    with FakeOpenAIServer(omit_usage=True) as server:
        server.enqueue(openai_text_reply("hi"))
        model = _model(server, stream=stream)
        response = await model.complete(_request())
        await model.aclose()
    assert response.text == "hi" and not response.usage_reported and response.usage == Usage()
    assert server.billed.total > 0  # the server did the work all the same


@pytest.mark.parametrize("stream", [False, True])
async def test_missing_tool_call_ids_round_trip(stream: bool) -> None:
    """Calls without ids get stable `call_` ids, which the next request answers and the server accepts."""
    with FakeOpenAIServer(omit_tool_call_ids=True) as server:
        server.enqueue(
            openai_tool_reply([("refund_policy", {}), ("svc_order_lookup", {"order_id": "A1"})]),
            openai_text_reply("done"),
        )
        model = _model(server, stream=stream, strict_validation=False)  # `id` is required by the SDK's schema
        request = _request()
        first = await model.complete(request)
        ids = [u.id for u in first.tool_uses]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
        assert "id" not in json.dumps(server.requests[0].body.get("tool_calls", []))
        results = Message(role="user", content=[ToolResultBlock(tool_use_id=i, content="{}") for i in ids])
        final = await model.complete(
            request.model_copy(update={"messages": [*request.messages, first.as_message(), results]})
        )
        await model.aclose()
    assert final.text == "done"
    assert [m["tool_call_id"] for m in server.requests[1].messages if m["role"] == "tool"] == ids


async def test_streamed_ids_repeated_on_every_delta() -> None:
    """A server repeating the id on every tool-call delta still yields one call per index."""
    with FakeOpenAIServer(repeat_stream_ids=True) as server:
        server.enqueue(
            openai_tool_reply([("svc_order_lookup", {"order_id": "A12345678901234567890"}), ("refund_policy", {})])
        )
        model = _model(server, stream=True)
        response = await model.complete(_request())
        await model.aclose()
    assert [(u.name, u.input) for u in response.tool_uses] == [
        ("svc.order.lookup", {"order_id": "A12345678901234567890"}),
        ("refund_policy", {}),
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("arguments", "tool", "expected_input", "expected_invalid"),
    [
        (None, "svc_order_lookup", {}, "null"),
        ("{not json", "svc_order_lookup", {}, "{not json"),
        ('["A1"]', "svc_order_lookup", {}, '["A1"]'),
        ("", "svc_order_lookup", {}, ""),
        ("", "refund_policy", {}, None),
    ],
)
async def test_bad_arguments_never_crash(
    stream: bool, arguments: str | None, tool: str, expected_input: dict[str, Any], expected_invalid: str | None
) -> None:
    """null / broken / non-object / empty arguments -> input {} and invalid_input; "" for a no-parameter tool is {}."""
    with FakeOpenAIServer() as server:
        server.enqueue(openai_tool_reply([(tool, arguments)]))
        model = _model(server, stream=stream, strict_validation=arguments is not None)
        response = await model.complete(_request())
        await model.aclose()
    (use,) = response.tool_uses
    assert use.input == expected_input and use.invalid_input == expected_invalid


async def test_invalid_arguments_are_sent_back_verbatim(server: FakeOpenAIServer) -> None:
    """A call with invalid arguments is replayed in the history with its raw text, and the server accepts it."""
    server.enqueue(openai_tool_reply([("svc_order_lookup", "{oops")]), openai_text_reply("sorry"))
    model = _model(server)
    request = _request()
    first = await model.complete(request)
    (use,) = first.tool_uses
    answer = Message(
        role="user", content=[ToolResultBlock(tool_use_id=use.id, content="invalid arguments", is_error=True)]
    )
    await model.complete(request.model_copy(update={"messages": [*request.messages, first.as_message(), answer]}))
    await model.aclose()
    sent = server.requests[1].messages
    assert sent[2]["tool_calls"][0]["function"]["arguments"] == "{oops"
    assert sent[3]["content"] == "ERROR: invalid arguments"


class _Verdict(BaseModel):
    passed: bool


FORM = FormSpec(
    tool=ToolDef(
        name="submit.verdict",
        input_schema={"type": "object", "properties": {"passed": {"type": "boolean"}}, "required": ["passed"]},
    ),
    schema=_Verdict,
    correction=lambda problems: "Call submit.verdict: " + "; ".join(problems),
    missing=lambda response: "you answered in text; call submit.verdict",
    ignored="ignored",
)


async def test_forced_form_recovers_when_the_server_ignores_tool_choice() -> None:
    """A server ignoring the forced tool answers text; the forced-form correction turn gets the call on retry."""
    with FakeOpenAIServer(ignore_tool_choice=True) as server:
        server.enqueue(
            openai_text_reply("I think it passed."), openai_tool_reply([("submit_verdict", {"passed": True})])
        )
        model = _model(server)
        outcome = await ask_forced(
            model, FORM, system="Judge.", prompt="Did it pass?", attempts=2, max_tokens=200, metadata={}
        )
        await model.aclose()
    assert outcome.value == _Verdict(passed=True) and outcome.attempts == 2
    second = server.requests[1]
    assert second.body["tool_choice"] == {"type": "function", "function": {"name": "submit_verdict"}}
    assert second.messages[-2] == {"role": "assistant", "content": "I think it passed."}
    assert second.messages[-1]["role"] == "user" and "call submit.verdict" in second.messages[-1]["content"]
    assert second.tool_choice_ignored and second.request.tool_choice is None


# -- configuration ---------------------------------------------------------------------------------


def test_missing_key_names_the_variable() -> None:
    """No key and no OPENAI_API_KEY -> ModelConfigError naming the variable (or the one api_key_env names)."""
    with pytest.raises(ModelConfigError, match="OPENAI_API_KEY"):
        OpenAIModel("gpt-test")
    with pytest.raises(ModelConfigError, match="AZURE_OPENAI_API_KEY"):
        OpenAIModel("gpt-test", api_key_env="AZURE_OPENAI_API_KEY")


def test_azure_without_api_version_is_a_config_error() -> None:
    """Azure needs an api_version (or OPENAI_API_VERSION): without one, ModelConfigError, not an SDK error."""
    with pytest.raises(ModelConfigError, match="api_version"):
        OpenAIModel("dep", api_key=TEST_KEY, azure_endpoint="http://127.0.0.1:1")


def test_context_length_error_pickles_with_its_fields() -> None:
    """ContextLengthError crosses arq: it pickles back to its class with status and request id."""
    error = pickle.loads(pickle.dumps(ContextLengthError("too long", status=400, request_id="req_1")))
    assert type(error) is ContextLengthError and isinstance(error, TerminalModelError)
    assert (error.status, error.request_id, error.retryable) == (400, "req_1", False)


def test_bad_max_tokens_param_is_refused() -> None:
    """max_tokens_param accepts only the two field names Chat Completions knows."""
    with pytest.raises(ModelConfigError, match="max_tokens_param"):
        OpenAIModel("gpt-test", api_key=TEST_KEY, max_tokens_param="n_predict")


async def test_key_and_base_url_from_environment(server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPENAI_API_KEY and OPENAI_BASE_URL are used when no arguments are given; api_key_env picks another key."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("LOCAL_LLM_KEY", "sk-local")
    server.enqueue(openai_text_reply("env"), openai_text_reply("local"))
    model = OpenAIModel("gpt-test")
    assert (await model.complete(_request())).text == "env"
    await model.aclose()
    local = OpenAIModel("gpt-test", api_key_env="LOCAL_LLM_KEY")
    assert (await local.complete(_request())).text == "local"
    await local.aclose()
    assert [r.headers["authorization"] for r in server.requests] == ["Bearer sk-from-env", "Bearer sk-local"]


async def test_azure_endpoint_uses_the_azure_client(server: FakeOpenAIServer) -> None:
    """With azure_endpoint the deployment path, api-version and api-key header of Azure OpenAI are used."""
    server.enqueue(openai_text_reply("azure"))
    endpoint = server.base_url.removesuffix("/v1")
    model = OpenAIModel("my-deployment", api_key=TEST_KEY, azure_endpoint=endpoint, api_version="2024-10-21")
    response = await model.complete(_request())
    await model.aclose()
    assert response.text == "azure"
    wire = server.requests[0]
    assert wire.path == "/openai/deployments/my-deployment/chat/completions"
    assert wire.headers["api-key"] == TEST_KEY


# -- the fake server itself -------------------------------------------------------------------------


async def test_neutral_model_drives_the_fake(server: FakeOpenAIServer) -> None:
    """openai_responder_from_model(DemoModel) answers real SDK calls; a ModelResponse is a script item too."""
    server.enqueue(ModelResponse(content=[TextBlock(text="scripted")], stop_reason="stop", usage=Usage(), model="x"))
    server.respond_with(openai_responder_from_model(DemoModel(latency=0)))
    model = _model(server)
    assert (await model.complete(_request())).text == "scripted"
    response = await model.complete(_request(Message.user("Can order A101 be refunded?")))
    await model.aclose()
    assert (response.tool_uses[0].name, response.tool_uses[0].input) == ("svc.order.lookup", {"order_id": "A101"})
    assert response.stop_reason == "tool_call"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        (
            [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c9", "content": "x"}],
            "messages.[1].role",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "user", "content": "no result"},
            ],
            "messages",
        ),
    ],
)
async def test_fake_refuses_bodies_openai_would(
    server: FakeOpenAIServer, messages: list[dict[str, Any]], param: str
) -> None:
    """Unknown roles and tool messages that answer no call get OpenAI's 400, so adapter drift shows."""
    client = openai.AsyncOpenAI(api_key=TEST_KEY, base_url=server.base_url, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="gpt-test", messages=messages)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="model"):
        await client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert caught.value.param == param


async def test_unscripted_request_gets_a_500_saying_so(server: FakeOpenAIServer) -> None:
    """Nothing enqueued and no responder: a 500 whose message says so (and the server stays up)."""
    client = openai.AsyncOpenAI(api_key=TEST_KEY, base_url=server.base_url, max_retries=0)
    with pytest.raises(openai.InternalServerError, match="nothing scripted"):
        await client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    assert server.pending == 0


async def test_raw_sdk_strict_validation_accepts_streamed_and_whole_replies(server: FakeOpenAIServer) -> None:
    """The fake's JSON and SSE chunks pass the SDK's strict validation; the usage chunk comes last."""
    server.enqueue(
        openai_tool_reply([("lookup", {"order_id": "A1"})], text="hi"),
        OpenAIReply(
            content="streamed", tool_calls=[ToolCall(name="lookup", arguments='{"a": 1}')], finish_reason="tool_calls"
        ),
    )
    client = openai.AsyncOpenAI(api_key=TEST_KEY, base_url=server.base_url, _strict_response_validation=True)
    tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    whole = await client.chat.completions.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}], tools=tools
    )
    assert whole.choices[0].finish_reason == "tool_calls" and whole.usage is not None
    stream = await client.chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "streamed"


def test_module_entrypoint_serves_the_openai_dialect() -> None:
    """`python -m llm.testing --dialect openai --port 0` serves Chat Completions answering with the demo rules."""
    command = [sys.executable, "-m", "llm.testing", "--dialect", "openai", "--port", "0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base_url = proc.stdout.readline().split(" on ", 1)[1].split(" ", 1)[0]
        client = openai.OpenAI(api_key=TEST_KEY, base_url=base_url, _strict_response_validation=True)
        completion = client.chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": "Can order A100 be refunded?"}],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "lookup_order",
                        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
                    },
                }
            ],
        )
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert base_url.endswith("/v1")
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "lookup_order"
    assert json.loads(call.function.arguments) == {"order_id": "A100"}
