"""The planning conversation: ask for `submit_plan`, send an invalid plan back with its problems.

The protocol (docs/internals.md, "The model protocol"): the planner forces the `submit_plan` tool; its input is
a `Plan`. An invalid plan is answered, in the next user turn, by a `tool_result` with
`is_error=true` for that very tool_use id (the API requires every tool_use to be answered at the
start of the next user message), listing every problem, and the model tries again, at most
`attempts` times in all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
from pydantic import ValidationError

from bus.schemas import Plan, json_schema
from llm.port import ModelPort
from llm.types import (
    ContentBlock,
    Message,
    ModelRequest,
    ModelResponse,
    TextBlock,
    ToolChoice,
    ToolDef,
    ToolResultBlock,
)

from .prompts import PLAN_TOOL, PLAN_TOOL_DESCRIPTION, correction, pydantic_problems

log = structlog.get_logger("taskloom.planner")

PLAN_TOOL_DEF = ToolDef(name=PLAN_TOOL, description=PLAN_TOOL_DESCRIPTION, input_schema=json_schema(Plan))

Validator = Callable[[Plan], list[str]]


@dataclass(frozen=True)
class PlanOutcome:
    """A valid plan, or (plan None) the problems of the last attempt."""

    plan: Plan | None
    problems: list[str]
    attempts: int


def _parse(response: ModelResponse, validate: Validator) -> tuple[Plan | None, list[str]]:
    uses = [u for u in response.tool_uses if u.name == PLAN_TOOL]
    if not uses:
        why = "was cut off at max_tokens" if response.stop_reason == "max_tokens" else "did not call submit_plan"
        return None, [f"The reply {why}; submit the whole plan with the submit_plan tool."]
    try:
        plan = Plan.model_validate(uses[0].input)
    except ValidationError as exc:
        return None, pydantic_problems(exc)
    problems = validate(plan)
    return (None, problems) if problems else (plan, [])


def _answer(response: ModelResponse, problems: list[str]) -> Message:
    """The user turn that sends the plan back: a tool_result for every tool_use, then a nudge."""
    uses = response.tool_uses
    target = next((u.id for u in uses if u.name == PLAN_TOOL), uses[0].id if uses else None)
    content: list[ContentBlock] = []
    for use in uses:
        text = correction(problems) if use.id == target else "Ignored: call submit_plan once with the whole plan."
        content.append(ToolResultBlock(tool_use_id=use.id, content=text, is_error=True))
    if not content:
        content.append(TextBlock(text=correction(problems)))
    return Message(role="user", content=content)


async def ask_for_plan(
    model: ModelPort,
    *,
    system: str,
    prompt: str,
    validate: Validator,
    attempts: int,
    max_tokens: int,
    metadata: dict[str, str],
) -> PlanOutcome:
    """Run the conversation until a plan passes `validate` or `attempts` replies were refused.

    Raises what the model raises (`ModelError`, or the ledger's `BudgetExhausted`).
    """
    messages = [Message.user(prompt)]
    problems: list[str] = []
    for attempt in range(1, attempts + 1):
        request = ModelRequest(
            system=system,
            messages=messages,
            tools=[PLAN_TOOL_DEF],
            tool_choice=ToolChoice.force(PLAN_TOOL),
            max_tokens=max_tokens,
            metadata=metadata,
        )
        response = await model.complete(request)
        plan, problems = _parse(response, validate)
        if plan is not None:
            return PlanOutcome(plan=plan, problems=[], attempts=attempt)
        log.warning("plan.invalid", attempt=attempt, problems=problems)
        if response.content:
            # An empty reply (cut at max_tokens before any block) cannot be replayed as a turn.
            messages = [*messages, response.as_message(), _answer(response, problems)]
    return PlanOutcome(plan=None, problems=problems, attempts=attempts)
