"""Test support shipped with `llm`: a fake Anthropic Messages API server and a network guard.

A fake, not a mock: the real SDK talks HTTP to it, so tests exercise the same code as production.
"""

from llm.testing.guard import (
    NetworkBlockedError,
    blocked_attempts,
    clear_anthropic_env,
    clear_blocked_attempts,
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

__all__ = [
    "Failure",
    "FakeAnthropicServer",
    "NetworkBlockedError",
    "RecordedRequest",
    "Reply",
    "Script",
    "blocked_attempts",
    "clear_anthropic_env",
    "clear_blocked_attempts",
    "content_text",
    "error_body",
    "install_network_guard",
    "malformed",
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
