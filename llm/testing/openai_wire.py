"""The Chat Completions dialect for the fake OpenAI server: what it can be told to answer, and the
translation between wire bodies and the port's types.

`openai_request_from_wire` is the inverse of `llm.openai.build_params` (tool ids and names kept), so
any neutral model answers real SDK calls: `openai_responder_from_model(DemoModel())` scripts a
`FakeOpenAIServer` as `responder_from_model` scripts the Anthropic one.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llm.openai import ERROR_PREFIX, OPENAI_FINISH_REASONS, tool_call_arguments
from llm.pairing import check_tool_pairing
from llm.testing.script import Failure
from llm.testing.wire import RespondsSync
from llm.toolnames import VALID
from llm.types import (
    ContentBlock,
    Message,
    ModelRequest,
    ModelResponse,
    TextBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
    ToolUseBlock,
)

if TYPE_CHECKING:
    from llm.testing.openai_server import RecordedRequest

_ids = itertools.count(1)

ROLES = ("system", "developer", "user", "assistant", "tool")


def new_call_id() -> str:
    return f"call_fake_{next(_ids):06d}"


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a reply. `arguments` is sent verbatim: a JSON string, or None for `null`."""

    name: str
    arguments: str | None = "{}"
    id: str | None = field(default_factory=new_call_id)  # None or "": the call goes out without an id


@dataclass(frozen=True)
class OpenAIReply:
    """A successful Chat Completions answer.

    `finish_reason` None is sent as JSON null (a local server's habit; in a stream, `OpenAIModel` reads
    a stream that never says why it finished as cut). `output_tokens` overrides the
    counted output; `delay` (seconds, from the request's arrival) is the model's response time.
    Quirks for this reply alone: `omit_usage` (no `usage` object, nor usage chunk when streamed),
    `omit_ids` (tool calls without an `id`). `headers` are added to the response. `cut_after` closes a
    streamed reply's connection after that many chunks (no finish, no [DONE]).
    """

    content: str | None = None
    tool_calls: Sequence[ToolCall] = ()
    finish_reason: str | None = "stop"
    model: str | None = None
    output_tokens: int | None = None
    delay: float = 0.0
    omit_usage: bool = False
    omit_ids: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    cut_after: int | None = None  # streamed: close the connection after this many chunks


OpenAIScript = OpenAIReply | ModelResponse | Failure


def openai_text_reply(text: str, *, finish_reason: str | None = "stop", **kwargs: Any) -> OpenAIReply:
    """A reply with a text message."""
    return OpenAIReply(content=text, finish_reason=finish_reason, **kwargs)


def openai_tool_reply(
    calls: Sequence[tuple[str, Mapping[str, Any] | str | None]], *, text: str | None = None, **kwargs: Any
) -> OpenAIReply:
    """A reply calling each `(name, arguments)` in one turn (parallel tool calls), optionally with text.
    `arguments` is a mapping (sent as JSON), a string (sent verbatim, e.g. broken JSON) or None (null)."""
    tool_calls = [
        ToolCall(name=name, arguments=json.dumps(dict(args)) if isinstance(args, Mapping) else args)
        for name, args in calls
    ]
    kwargs.setdefault("finish_reason", "tool_calls")
    return OpenAIReply(content=text, tool_calls=tool_calls, **kwargs)


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


def openai_error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The error JSON the API sends with a non-2xx status."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_rate_limited(retry_after: float = 1.0, *, ms: bool = False) -> Failure:
    """429 with `retry-after` (seconds) or `retry-after-ms`, which the SDK honours."""
    headers = {"retry-after-ms": f"{retry_after * 1000:g}"} if ms else {"retry-after": f"{retry_after:g}"}
    return Failure(
        status=429, headers=headers, body=openai_error_body(429, "Rate limit reached", code="rate_limit_exceeded")
    )


def context_length_exceeded(tokens: int = 200_000, limit: int = 128_000) -> Failure:
    """The 400 OpenAI sends for a prompt that does not fit the context window."""
    message = (
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
        f"{tokens} tokens. Please reduce the length of the messages."
    )
    return Failure(status=400, body=openai_error_body(400, message, code="context_length_exceeded", param="messages"))


# -- wire -> port ----------------------------------------------------------------------------


def _text(content: Any) -> str:
    """A message's content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _tool_use(call: Mapping[str, Any]) -> ToolUseBlock:
    function = call.get("function") or {}
    raw = function.get("arguments")
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        value = None
    if isinstance(value, dict):
        return ToolUseBlock(id=str(call.get("id")), name=str(function.get("name")), input=value)
    return ToolUseBlock(
        id=str(call.get("id")), name=str(function.get("name")), invalid_input=raw if isinstance(raw, str) else "null"
    )


def openai_request_from_wire(body: Mapping[str, Any]) -> ModelRequest:
    """The port request a Chat Completions body expresses (the inverse of `llm.openai.build_params`).

    System and developer messages make the system prompt; a run of tool messages, and the user
    message right after it, make one user turn (tool_results first). A tool message whose content
    starts with `ERROR_PREFIX` reads as `is_error` (its content kept as sent). Raises ValueError (a
    `ToolPairingError` for pairing) when a well-behaved client could not have sent the body.
    """
    system: list[str] = []
    messages: list[Message] = []
    pending_user: list[ContentBlock] = []
    after_tools = False

    def flush() -> None:
        nonlocal pending_user
        if pending_user:
            messages.append(Message(role="user", content=pending_user))
        pending_user = []

    for raw in body.get("messages") or []:
        role = raw.get("role")
        if role in ("system", "developer"):
            system.append(_text(raw.get("content")))
            continue
        if role == "tool":
            if not after_tools:
                flush()
            after_tools = True
            content = _text(raw.get("content"))
            pending_user.append(
                ToolResultBlock(
                    tool_use_id=str(raw.get("tool_call_id")),
                    content=content,
                    is_error=content.startswith(ERROR_PREFIX.strip()),
                )
            )
            continue
        if role == "user":
            if not after_tools:
                flush()
            pending_user.append(TextBlock(text=_text(raw.get("content"))))
            flush()
            after_tools = False
            continue
        if role != "assistant":
            raise ValueError(f"unknown role {role!r}")
        flush()
        after_tools = False
        blocks: list[ContentBlock] = []
        text = _text(raw.get("content"))
        if text:
            blocks.append(TextBlock(text=text))
        blocks += [_tool_use(c) for c in raw.get("tool_calls") or []]
        if blocks:
            messages.append(Message(role="assistant", content=blocks))
    flush()
    check_tool_pairing(messages)
    return ModelRequest(
        system="\n\n".join(system),
        messages=messages,
        tools=[
            ToolDef(
                name=str(t["function"]["name"]),
                description=str(t["function"].get("description") or ""),
                input_schema=dict(t["function"].get("parameters") or {"type": "object", "properties": {}}),
            )
            for t in body.get("tools") or []
        ],
        tool_choice=_tool_choice(body),
        max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 4096),
        stop_sequences=[body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or []),
    )


def _tool_choice(body: Mapping[str, Any]) -> ToolChoice | None:
    choice = body.get("tool_choice")
    disable_parallel = body.get("parallel_tool_calls") is False
    if choice is None:
        return ToolChoice(disable_parallel=True) if disable_parallel else None
    if isinstance(choice, dict):
        return ToolChoice(type="tool", name=str(choice["function"]["name"]), disable_parallel=disable_parallel)
    kinds = {"auto": "auto", "required": "any", "none": "none"}
    return ToolChoice.model_validate({"type": kinds[choice], "disable_parallel": disable_parallel})


def validate_chat_body(body: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """(message, param) of the 400 OpenAI would answer `body` with, or None when it is acceptable."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter", "model"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must contain at least one message", "messages"
    open_ids: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            return (
                f"Invalid value: {role!r}. Supported values are: {', '.join(map(repr, ROLES))}.",
                f"messages[{i}].role",
            )
        if role == "tool":
            if message.get("tool_call_id") not in open_ids:
                return (
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
                    "with 'tool_calls'.",
                    f"messages.[{i}].role",
                )
            open_ids.remove(message["tool_call_id"])
            continue
        if open_ids:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(open_ids)}",
                "messages",
            )
        if role == "assistant":
            open_ids = [str(c.get("id")) for c in message.get("tool_calls") or []]
    tools = body.get("tools") or []
    names = [str((t.get("function") or {}).get("name", "")) for t in tools]
    for name in names:
        if not VALID.match(name):
            return (
                f"Invalid 'tools[].function.name': string does not match pattern '^[a-zA-Z0-9_-]{{1,64}}$': {name!r}",
                "tools",
            )
    choice = body.get("tool_choice")
    if choice is not None and not tools and choice != "none":
        return (
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            "tool_choice",
        )
    if isinstance(choice, dict) and (choice.get("function") or {}).get("name") not in names:
        return f"Invalid value for 'tool_choice': no function named {choice!r} was specified in 'tools'", "tool_choice"
    if isinstance(choice, str) and choice not in ("auto", "required", "none"):
        return f"Invalid value: {choice!r}. Supported values are: 'none', 'auto' and 'required'.", "tool_choice"
    if body.get("stream_options") is not None and not body.get("stream"):
        return "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
    if "parallel_tool_calls" in body and not tools:
        return (
            "Invalid value for 'parallel_tool_calls': only allowed when 'tools' are specified.",
            "parallel_tool_calls",
        )
    try:
        openai_request_from_wire(body)
    except ValueError as err:
        return f"Invalid request: {err}", "messages"
    return None


# -- port -> wire ----------------------------------------------------------------------------

# The wire name of each neutral stop reason (the first Chat Completions name that maps onto it).
TO_OPENAI: dict[str, str] = {}
for _wire, _neutral in OPENAI_FINISH_REASONS.items():
    TO_OPENAI.setdefault(_neutral, _wire)
TO_OPENAI.update({"pause": "stop", "context_length": "length"})


def openai_reply_from_response(response: ModelResponse, *, delay: float = 0.0) -> OpenAIReply:
    """A fake-server reply carrying `response`'s text, tool calls and stop reason (usage is recounted;
    thinking blocks are dropped, as Chat Completions has none)."""
    return OpenAIReply(
        content=response.text or None,
        tool_calls=[ToolCall(name=u.name, arguments=tool_call_arguments(u), id=u.id) for u in response.tool_uses],
        finish_reason=TO_OPENAI[response.stop_reason],
        delay=delay,
    )


def openai_responder_from_model(model: RespondsSync) -> Callable[[RecordedRequest], OpenAIScript]:
    """A `respond_with` function answering each request with `model.respond(request)`: a synchronous,
    pure `ModelRequest -> ModelResponse` method such as `DemoModel.respond`."""

    def respond(recorded: RecordedRequest) -> OpenAIScript:
        return openai_reply_from_response(model.respond(recorded.request))

    return respond
