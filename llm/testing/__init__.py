"""Test support shipped with `llm`: fake Anthropic Messages and OpenAI Chat Completions servers, and a
network guard.

A fake, not a mock: the real SDK talks HTTP to it, so tests exercise the same code as production.
"""

from typing import TYPE_CHECKING, Any

from llm.testing.guard import (
    NetworkBlockedError,
    blocked_attempts,
    clear_anthropic_env,
    clear_blocked_attempts,
    clear_openai_env,
    install_network_guard,
    uninstall_network_guard,
)
from llm.testing.script import (
    Failure,
    Reply,
    Script,
    error_body,
    malformed,
    overloaded,
    rate_limited,
    server_error,
    text_reply,
    tool_reply,
)
from llm.testing.server import FakeAnthropicServer, RecordedRequest, sse_events
from llm.testing.wire import content_text, reply_from_response, request_from_wire, responder_from_model

if TYPE_CHECKING:
    from llm.testing.openai_server import FakeOpenAIServer
    from llm.testing.openai_wire import (
        OpenAIReply,
        ToolCall,
        context_length_exceeded,
        openai_error_body,
        openai_rate_limited,
        openai_reply_from_response,
        openai_request_from_wire,
        openai_responder_from_model,
        openai_text_reply,
        openai_tool_reply,
    )

# The OpenAI fake needs the `openai` SDK (an extra): imported when first asked for, so that the
# Anthropic fake and the testing kit work without it.
_OPENAI = {
    "FakeOpenAIServer": "llm.testing.openai_server",
    **dict.fromkeys(
        (
            "OpenAIReply",
            "ToolCall",
            "context_length_exceeded",
            "openai_error_body",
            "openai_rate_limited",
            "openai_reply_from_response",
            "openai_request_from_wire",
            "openai_responder_from_model",
            "openai_text_reply",
            "openai_tool_reply",
        ),
        "llm.testing.openai_wire",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _OPENAI:
        import importlib

        return getattr(importlib.import_module(_OPENAI[name]), name)
    raise AttributeError(f"module 'llm.testing' has no attribute {name!r}")


__all__ = [
    "Failure",
    "FakeAnthropicServer",
    "FakeOpenAIServer",
    "NetworkBlockedError",
    "OpenAIReply",
    "RecordedRequest",
    "Reply",
    "Script",
    "ToolCall",
    "blocked_attempts",
    "clear_anthropic_env",
    "clear_blocked_attempts",
    "clear_openai_env",
    "content_text",
    "context_length_exceeded",
    "error_body",
    "install_network_guard",
    "malformed",
    "openai_error_body",
    "openai_rate_limited",
    "openai_reply_from_response",
    "openai_request_from_wire",
    "openai_responder_from_model",
    "openai_text_reply",
    "openai_tool_reply",
    "overloaded",
    "rate_limited",
    "reply_from_response",
    "request_from_wire",
    "responder_from_model",
    "server_error",
    "sse_events",
    "text_reply",
    "tool_reply",
    "uninstall_network_guard",
]
