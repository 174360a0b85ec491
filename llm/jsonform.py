"""Structured output as a JSON reply: ask for one JSON object in plain text, validate it against a
schema, and send the problems back in the next user turn.

Why not a forced tool (`llm.forced`) for every form: a request that offers any tool pays the
provider's tool-use system prompt (about 300 input tokens) plus the tool's definition, on every
call. A small form that fits on one line of the system prompt (the critic's verdict: three fields)
costs a fraction of that as text, and the critic reviews every task. Larger forms (a plan, a final
answer of any length with its verdict) stay forced tools, where the JSON is the provider's to
escape, not the model's to write in prose.

The reply is validated as a forced tool's input is (the same pydantic schema, the same sentences
naming the field), except that keys the form does not have are left out, and an invalid reply gets
one corrective turn by default. The object is read from the first `{` to the last `}` of the reply's
text, so a model that wraps it in a code fence or a sentence is still understood.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from .forced import FormOutcome, validation_problems
from .port import ModelPort
from .types import Message, ModelRequest, ModelResponse

M = TypeVar("M", bound=BaseModel)

log = structlog.get_logger("taskloom.llm")


@dataclass(frozen=True)
class JsonForm(Generic[M]):
    """One JSON form: the model its object must be, and how problems are phrased."""

    schema: type[M]
    correction: Callable[[list[str]], str]  # the user turn sending an invalid reply back
    root: str = "reply"  # how a problem with the whole object names it
    event: str = "json_form.invalid"  # the warning logged for each refused reply


def json_object(text: str) -> str | None:
    """The text from the first `{` to the last `}`, or None when there is no such span."""
    start, end = text.find("{"), text.rfind("}")
    return text[start : end + 1] if 0 <= start < end else None


def parse(response: ModelResponse, form: JsonForm[M]) -> tuple[M | None, list[str]]:
    """The reply's object validated against the form's schema, or the problems (naming the field)."""
    if response.stop_reason == "length":
        return None, [f"the reply was cut at max_tokens before the {form.root} object was complete"]
    raw = json_object(response.text)
    if raw is None:
        return None, [f"the reply holds no JSON object: reply with only the {form.root} object"]
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return None, [f"the reply's {form.root} object is not valid JSON ({exc})"]
    if not isinstance(data, dict):
        return None, [f"the reply's {form.root} is not a JSON object"]
    # Keys the form does not have (a model adding "reason" or "confidence") are left out rather
    # than refused: a written reply has no schema to hold it to, and a correction costs a call.
    known = {k: v for k, v in data.items() if k in form.schema.model_fields}
    try:
        return form.schema.model_validate(known), []
    except ValidationError as exc:
        return None, validation_problems(exc, form.root, ".")


async def ask_json(
    model: ModelPort,
    form: JsonForm[M],
    *,
    system: str,
    prompt: str,
    attempts: int,
    max_tokens: int,
    metadata: dict[str, str],
    logger: structlog.typing.FilteringBoundLogger | None = None,
) -> FormOutcome[M]:
    """Ask (no tools offered) until the reply's object validates or `attempts` replies were refused.
    Raises what the model raises (`ModelError`, or the ledger's `BudgetExhausted`)."""
    messages = [Message.user(prompt)]
    problems: list[str] = []
    for attempt in range(1, attempts + 1):
        request = ModelRequest(system=system, messages=messages, tools=[], max_tokens=max_tokens, metadata=metadata)
        response = await model.complete(request)
        value, problems = parse(response, form)
        if value is not None:
            return FormOutcome(value=value, problems=[], attempts=attempt)
        (logger or log).warning(form.event, attempt=attempt, problems=problems)
        if response.content and not response.tool_uses:
            # A reply with a tool_use (no tool was offered, so none should come) would need a
            # tool_result to be replayed; asking afresh is simpler and as good.
            messages = [*messages, response.as_message(), Message.user(form.correction(problems))]
    return FormOutcome(value=None, problems=problems, attempts=attempts)
