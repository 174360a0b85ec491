"""Translate between Messages API wire bodies and the port's types, for the fake server.

This is what lets any `ModelPort` (the demo model, a test's own function) answer real SDK calls:
`responder_from_model(DemoModel())` scripts a `FakeAnthropicServer` for end-to-end runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from llm.anthropic import STOP_REASONS
from llm.pairing import check_tool_pairing
from llm.testing.script import Reply, Script
from llm.types import (
    ContentBlock,
    Message,
    ModelRequest,
    ModelResponse,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)

if TYPE_CHECKING:
    from llm.testing.server import RecordedRequest


class RespondsSync(Protocol):
    def respond(self, request: ModelRequest) -> ModelResponse: ...


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return ""


def content_text(content: Any) -> str:
    """The readable text of wire-format content (a string, or blocks), one line per text block and
    per tool_result: what a scripted responder matches its routing rules against."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif block.get("type") == "tool_result":
            parts.append(content_text(block.get("content")))
    return "\n".join(parts)


def _block(raw: Mapping[str, Any]) -> ContentBlock | None:
    kind = raw.get("type")
    if kind == "text":
        return TextBlock(text=str(raw.get("text", "")))
    if kind == "tool_use":
        return ToolUseBlock(id=str(raw["id"]), name=str(raw["name"]), input=dict(raw.get("input") or {}))
    if kind == "tool_result":
        return ToolResultBlock(
            tool_use_id=str(raw["tool_use_id"]), content=_text(raw.get("content")), is_error=bool(raw.get("is_error"))
        )
    if kind == "thinking":
        return ThinkingBlock(thinking=str(raw.get("thinking", "")), signature=str(raw.get("signature", "")))
    return None  # images, documents...: not part of our port


def request_from_wire(body: Mapping[str, Any]) -> ModelRequest:
    """The port request a wire body expresses (cache_control and metadata dropped). Raises ValueError
    (a `ToolPairingError` for pairing) when the body could not be sent by a well-behaved client."""
    messages = []
    for raw in body.get("messages") or []:
        content = raw.get("content")
        blocks = [TextBlock(text=content)] if isinstance(content, str) else [_block(b) for b in content or []]
        messages.append(Message(role=raw["role"], content=[b for b in blocks if b is not None]))
    check_tool_pairing(messages)
    choice = body.get("tool_choice")
    system = body.get("system") or ""
    return ModelRequest(
        system=system if isinstance(system, str) else _text(system),
        messages=messages,
        tools=[
            ToolDef(name=t["name"], description=t.get("description", ""), input_schema=t.get("input_schema", {}))
            for t in body.get("tools") or []
        ],
        tool_choice=(
            ToolChoice(
                type=choice["type"],
                name=choice.get("name"),
                disable_parallel=bool(choice.get("disable_parallel_tool_use")),
            )
            if choice
            else None
        ),
        max_tokens=int(body["max_tokens"]),
        stop_sequences=list(body.get("stop_sequences") or []),
    )


# The wire name of each neutral stop reason (the first Anthropic name that maps onto it).
TO_ANTHROPIC: dict[str, str] = {}
for _wire, _neutral in STOP_REASONS.items():
    TO_ANTHROPIC.setdefault(_neutral, _wire)


def reply_from_response(response: ModelResponse, *, delay: float = 0.0) -> Reply:
    """A fake-server reply carrying `response`'s content and stop reason (usage is recounted)."""
    return Reply(
        content=[b.model_dump(exclude_defaults=False) for b in response.content],
        stop_reason=TO_ANTHROPIC[response.stop_reason],
        delay=delay,
    )


def responder_from_model(model: RespondsSync) -> Callable[[RecordedRequest], Script]:
    """A `respond_with` function that answers each request with `model.respond(request)`: a synchronous,
    pure `ModelRequest -> ModelResponse` method such as `DemoModel.respond`."""

    def respond(recorded: RecordedRequest) -> Script:
        return reply_from_response(model.respond(request_from_wire(recorded.body)))

    return respond
