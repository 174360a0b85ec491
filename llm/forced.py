"""The forced-tool protocol: ask with one forced tool, validate its input, send the problems back.

The planner (`submit_plan`) and the critic's final answer (`submit_final`) get structured output
this way (docs/internals.md, "The model protocol"); the critic's short task verdict is a JSON reply
instead (`llm.jsonform`). An invalid reply is answered, in the next user turn, by a
`tool_result` with `is_error=true` for every tool_use of that reply (the API requires each to be
answered at the start of the next user message): the forced tool's with the problems, any other
with `ignored`. The model tries again, at most `attempts` times in all.

Also the one formatter of pydantic errors as sentences naming the field (`validation_problems`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from .port import ModelPort
from .types import ContentBlock, Message, ModelRequest, ModelResponse, TextBlock, ToolChoice, ToolDef, ToolResultBlock

M = TypeVar("M", bound=BaseModel)

log = structlog.get_logger("taskloom.llm")


def field_path(loc: Sequence[int | str], root: str = "input") -> str:
    """`tasks[2].definition_of_done` for a pydantic error location; `root` for the whole input."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or root


def validation_problems(exc: ValidationError, root: str = "input", end: str = "") -> list[str]:
    """A schema error as sentences naming the field, e.g. `tasks[2].definition_of_done: Field required`."""
    return [f"{field_path(err['loc'], root)}: {err['msg']}{end}" for err in exc.errors(include_url=False)]


@dataclass(frozen=True)
class FormSpec(Generic[M]):
    """One forced tool: its definition, the model its input must be, and how problems are phrased."""

    tool: ToolDef
    schema: type[M]
    correction: Callable[[list[str]], str]  # the tool_result sending an invalid input back
    missing: Callable[[ModelResponse], str]  # the problem when the reply did not call the tool
    ignored: str  # the tool_result of any other tool_use in the same reply
    root: str = "input"  # how a problem with the whole input names it
    event: str = "forced_tool.invalid"  # the warning logged for each refused reply


@dataclass(frozen=True)
class FormOutcome(Generic[M]):
    """A valid input, or (value None) the problems of the last reply."""

    value: M | None
    problems: list[str]
    attempts: int


def parse(
    response: ModelResponse, form: FormSpec[M], check: Callable[[M], list[str]] | None
) -> tuple[M | None, list[str]]:
    uses = [u for u in response.tool_uses if u.name == form.tool.name]
    if not uses:
        return None, [form.missing(response)]
    try:
        value = form.schema.model_validate(uses[0].input)
    except ValidationError as exc:
        return None, validation_problems(exc, form.root, ".")
    problems = check(value) if check is not None else []
    return (None, problems) if problems else (value, [])


def answer(response: ModelResponse, form: FormSpec[M], problems: list[str]) -> Message:
    """The user turn that sends the input back: a tool_result for every tool_use, or the correction."""
    uses = response.tool_uses
    target = next((u.id for u in uses if u.name == form.tool.name), uses[0].id if uses else None)
    content: list[ContentBlock] = [
        ToolResultBlock(
            tool_use_id=u.id, content=form.correction(problems) if u.id == target else form.ignored, is_error=True
        )
        for u in uses
    ]
    return Message(role="user", content=content or [TextBlock(text=form.correction(problems))])


async def ask_forced(
    model: ModelPort,
    form: FormSpec[M],
    *,
    system: str,
    prompt: str,
    attempts: int,
    max_tokens: int,
    metadata: dict[str, str],
    check: Callable[[M], list[str]] | None = None,
    logger: structlog.typing.FilteringBoundLogger | None = None,
    history: Sequence[Message] = (),
    also_offer: Sequence[ToolDef] = (),
    asked: int = 0,
) -> FormOutcome[M]:
    """Ask until the tool's input validates (and passes `check`) or `attempts` replies were refused.

    `history`: turns after the prompt that already happened (a reply that was not accepted and its
    answer), `asked` of them counted as attempts; `also_offer`: tools offered besides the forced one
    (those the history's turns may have called, which a conversation must keep defining).
    Raises what the model raises (`ModelError`, or the ledger's `BudgetExhausted`).
    """
    messages = [Message.user(prompt), *history]
    problems: list[str] = []
    for attempt in range(asked + 1, asked + attempts + 1):
        request = ModelRequest(
            system=system,
            messages=messages,
            tools=[*also_offer, form.tool],
            tool_choice=ToolChoice.force(form.tool.name),
            max_tokens=max_tokens,
            metadata=metadata,
        )
        response = await model.complete(request)
        value, problems = parse(response, form, check)
        if value is not None:
            return FormOutcome(value=value, problems=[], attempts=attempt)
        (logger or log).warning(form.event, attempt=attempt, problems=problems)
        if response.content:
            # An empty reply (cut at max_tokens before any block) cannot be replayed as a turn.
            messages = [*messages, response.as_message(), answer(response, form, problems)]
    return FormOutcome(value=None, problems=problems, attempts=asked + attempts)
