"""The port's types: serialisation, validation and helpers."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from llm import (
    Message,
    ModelConfigError,
    ModelConnectionError,
    ModelError,
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
from llm.port import ModelPort


def _request() -> ModelRequest:
    return ModelRequest(
        system="be brief",
        messages=[
            Message.user("Check A100"),
            Message(
                role="assistant",
                content=[
                    ThinkingBlock(thinking="hmm", signature="sig"),
                    ToolUseBlock(id="t1", name="svc.order.lookup", input={"order_id": "A100", "n": [1, 2]}),
                ],
            ),
            Message(role="user", content=[ToolResultBlock(tool_use_id="t1", content="{}", is_error=True)]),
        ],
        tools=[ToolDef(name="svc.order.lookup", description="d", input_schema={"type": "object"})],
        tool_choice=ToolChoice(type="any", disable_parallel=True),
        max_tokens=256,
        stop_sequences=["STOP"],
        metadata={"goal_id": "g1", "task_id": "t1"},
    )


def test_request_round_trips_through_json() -> None:
    """A request checkpointed as JSON comes back equal, blocks keeping their concrete types."""
    request = _request()
    again = ModelRequest.model_validate_json(request.model_dump_json())
    assert again == request
    assert isinstance(again.messages[1].content[0], ThinkingBlock)
    assert isinstance(again.messages[2].content[0], ToolResultBlock)


def test_response_round_trips_and_helpers() -> None:
    """A response round-trips through JSON; `.text` joins text blocks and `.tool_uses` lists the calls."""
    response = ModelResponse(
        content=[TextBlock(text="a"), ToolUseBlock(id="x", name="f", input={}), TextBlock(text="b")],
        stop_reason="tool_call",
        usage=Usage(input_tokens=1, output_tokens=2, cache_read_tokens=3, cache_write_tokens=4),
        request_id="req_1",
        model="m",
    )
    again = ModelResponse.model_validate_json(response.model_dump_json())
    assert again == response
    assert again.text == "ab"
    assert [t.id for t in again.tool_uses] == ["x"]
    assert again.usage.total == 10
    assert again.as_message().role == "assistant"


def test_usage_adds_fieldwise() -> None:
    """Usage sums field by field, as the ledger and the fake server's billing do."""
    total = Usage(input_tokens=1, output_tokens=2) + Usage(cache_read_tokens=5, cache_write_tokens=7, input_tokens=1)
    assert (total.input_tokens, total.output_tokens, total.cache_read_tokens, total.cache_write_tokens) == (2, 2, 5, 7)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"messages": []},
        {"max_tokens": 0},
        {"tool_choice": ToolChoice.force("missing")},
        {"tools": [ToolDef(name="a"), ToolDef(name="a")]},
    ],
)
def test_invalid_requests_are_refused(kwargs: dict[str, object]) -> None:
    """Empty history, non-positive max_tokens, forcing an unoffered tool and duplicate tools are refused."""
    base: dict[str, object] = {"messages": [Message.user("x")], "max_tokens": 10, "tools": [ToolDef(name="a")]}
    with pytest.raises(ValidationError):
        ModelRequest.model_validate({**base, **kwargs})


def test_tool_choice_name_goes_with_type_tool() -> None:
    """A tool choice has a name exactly when it forces a tool."""
    with pytest.raises(ValidationError):
        ToolChoice(type="tool")
    with pytest.raises(ValidationError):
        ToolChoice(type="auto", name="x")


@pytest.mark.parametrize(
    "error",
    [
        RetryableModelError("busy", status=529, request_id="req_1", retry_after=1.5),
        TerminalModelError("bad", status=400, request_id="req_2"),
        ModelTimeoutError("slow"),
        ModelConnectionError("refused"),
        ModelConfigError("set ANTHROPIC_API_KEY"),
        ToolNameCollisionError("a and b"),
        ToolPairingError("message 2"),
    ],
)
def test_errors_survive_pickling_with_their_fields(error: ModelError) -> None:
    """Errors cross arq pickled: class, message, status, request id, retryable and maybe_spent survive."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert again.__dict__ == error.__dict__
    assert str(again) == str(error)
    assert again.retryable == error.retryable


def test_error_classification() -> None:
    """Retryable and spent flags follow the taxonomy the ledger and the job layer rely on."""
    assert RetryableModelError("x").retryable and not TerminalModelError("x").retryable
    assert ModelTimeoutError("x").maybe_spent and not ModelConnectionError("x").maybe_spent
    assert isinstance(ToolNameCollisionError("x"), ValueError)
    assert isinstance(ToolPairingError("x"), ValueError)


def test_demo_and_adapter_satisfy_the_port() -> None:
    """Both implementations are `ModelPort`s (structurally)."""
    from llm import DemoModel
    from llm.anthropic import AnthropicModel

    assert isinstance(DemoModel(), ModelPort)
    assert isinstance(AnthropicModel("m", api_key="k", base_url="http://127.0.0.1:9"), ModelPort)


def test_stop_reasons_stored_under_anthropic_names_read_as_neutral_ones() -> None:
    """A checkpoint written with `end_turn`/`tool_use`/... reads back as `stop`/`tool_call`/...; others fail."""
    base = {"content": [{"type": "text", "text": "a"}], "usage": {}, "model": "m"}
    def read(name: str) -> str:
        return ModelResponse.model_validate({**base, "stop_reason": name}).stop_reason

    assert (read("end_turn"), read("stop_sequence"), read("tool_use")) == ("stop", "stop", "tool_call")
    assert (read("max_tokens"), read("refusal")) == ("length", "content_filter")
    assert (read("pause_turn"), read("model_context_window_exceeded")) == ("pause", "context_length")
    assert read("stop") == "stop"  # a neutral name reads as itself
    with pytest.raises(ValidationError):
        ModelResponse.model_validate({**base, "stop_reason": "whatever"})
