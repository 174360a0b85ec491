"""What the fake server can be told to answer: a `Reply` (a Messages API response) or a `Failure`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_ids = itertools.count(1)


def new_tool_use_id() -> str:
    return f"toolu_fake_{next(_ids):06d}"


@dataclass(frozen=True)
class Reply:
    """A successful response. `content` holds wire-format blocks (dicts, as the API sends them).

    `output_tokens` overrides the counted output; `delay` (seconds) is waited before answering,
    after the request has been billed, as a real provider bills work a client stopped waiting for.
    Streamed (`"stream": true`) only: `pace` (seconds) is waited before each content delta, so the
    reply is written over time as a model writes it; `cut_after` closes the connection after that
    many events (no `message_stop`), as a dropped connection does mid-reply.
    """

    content: Sequence[Mapping[str, Any]]
    stop_reason: str = "end_turn"
    stop_sequence: str | None = None
    model: str | None = None
    output_tokens: int | None = None
    delay: float = 0.0
    pace: float = 0.0
    cut_after: int | None = None


@dataclass(frozen=True)
class Failure:
    """An error response, or a broken one.

    `body`: None gives the API's standard error JSON for `status`; a dict is sent as JSON; a str is sent
    verbatim (malformed bodies). `disconnect=True` closes the connection without any response, after
    reading the request. `delay` is waited first (use it to trigger client timeouts).
    """

    status: int = 500
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Mapping[str, Any] | str | None = None
    delay: float = 0.0
    disconnect: bool = False


Script = Reply | Failure

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def text_reply(text: str, *, stop_reason: str = "end_turn", **kwargs: Any) -> Reply:
    """A reply with one text block."""
    return Reply(content=[{"type": "text", "text": text}], stop_reason=stop_reason, **kwargs)


def tool_reply(calls: Sequence[tuple[str, Mapping[str, Any]]], *, text: str | None = None, **kwargs: Any) -> Reply:
    """A reply calling each `(name, input)` in one turn (parallel tool use), optionally after a text."""
    content: list[Mapping[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [
        {"type": "tool_use", "id": new_tool_use_id(), "name": name, "input": dict(args)} for name, args in calls
    ]
    return Reply(content=content, stop_reason="tool_use", **kwargs)


def rate_limited(retry_after: float = 1.0) -> Failure:
    """429 with a `retry-after` header (seconds), which the SDK honours."""
    return Failure(status=429, headers={"retry-after": f"{retry_after:g}"})


def overloaded() -> Failure:
    """529 overloaded_error, as the API sends when it is under load."""
    return Failure(status=529)


def server_error(status: int = 500, *, should_retry: bool | None = None) -> Failure:
    """A 5xx; `should_retry` sets the `x-should-retry` header the SDK obeys over its own policy."""
    headers = {} if should_retry is None else {"x-should-retry": "true" if should_retry else "false"}
    return Failure(status=status, headers=headers)


def malformed(status: int = 200) -> Failure:
    """A response whose body is not valid JSON."""
    return Failure(status=status, body='{"id": "msg_broken", "content": [')
