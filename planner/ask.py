"""The planning conversation: ask for `submit_plan`, send an invalid plan back with its problems.

The protocol (docs/internals.md, "The model protocol", and `llm.forced`): the planner forces the
`submit_plan` tool; its input is a `Plan`. An invalid plan is answered by a `tool_result` with
`is_error=true` listing every problem, and the model tries again, at most `attempts` times in all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import structlog

from bus.schemas import Plan, PlanRoute, json_schema
from llm.forced import FormOutcome, FormSpec, answer, ask_forced, parse
from llm.port import ModelPort, TextSink
from llm.types import Message, ModelRequest, ModelResponse, ToolDef

from .prompts import PLAN_TOOL, PLAN_TOOL_DESCRIPTION, correction

log = structlog.get_logger("taskloom.planner")

PLAN_TOOL_DEF = ToolDef(name=PLAN_TOOL, description=PLAN_TOOL_DESCRIPTION, input_schema=json_schema(Plan))

Validator = Callable[[Plan], list[str]]


def _missing(response: ModelResponse) -> str:
    why = "was cut off at max_tokens" if response.stop_reason == "length" else "did not call submit_plan"
    return f"The reply {why}; submit the whole plan with the submit_plan tool."


PLAN_FORM = FormSpec(
    tool=PLAN_TOOL_DEF,
    schema=Plan,
    correction=correction,
    missing=_missing,
    ignored="Ignored: call submit_plan once with the whole plan.",
    event="plan.invalid",
)


async def ask_for_plan(
    model: ModelPort,
    *,
    system: str,
    prompt: str,
    validate: Validator,
    attempts: int,
    max_tokens: int,
    metadata: dict[str, str],
) -> FormOutcome[Plan]:
    """Run the conversation (`llm.forced`) until a plan passes `validate` or `attempts` replies were
    refused. Raises what the model raises (`ModelError`, or the ledger's `BudgetExhausted`)."""
    return await ask_forced(
        model,
        PLAN_FORM,
        system=system,
        prompt=prompt,
        attempts=attempts,
        max_tokens=max_tokens,
        metadata=metadata,
        check=validate,
        logger=log,
    )


# -- route first ------------------------------------------------------------------------------


def route_of(response: ModelResponse) -> Literal["plan", "tool", "text", "unclear"]:
    """What the planner's first (unforced) reply chose: a plan (`submit_plan` called, whatever else
    it called), the goal's own tools (the goal is one task that starts with this turn), a direct
    answer (text that ended normally), or nothing usable (cut off, refused, empty): then the plan
    is asked for with `submit_plan` forced."""
    names = [u.name for u in response.tool_uses]
    if PLAN_TOOL_DEF.name in names:
        return "plan"
    if response.stop_reason == "length":
        return "unclear"  # a tool call cut at max_tokens is lost; cut text is no answer
    if names and response.stop_reason == "tool_call":
        return "tool"
    if not names and response.stop_reason == "stop" and response.text.strip():
        return "text"
    return "unclear"


@dataclass(frozen=True)
class Routed:
    """The outcome of the first planning call: a plan (`outcome`), or a routed turn (`turn`)."""

    route: PlanRoute
    outcome: FormOutcome[Plan] | None = None
    turn: ModelResponse | None = None


async def ask_routed(
    model: ModelPort,
    *,
    system: str,
    prompt: str,
    tools: Sequence[ToolDef],
    validate: Validator,
    attempts: int,
    max_tokens: int,
    metadata: dict[str, str],
    on_text: TextSink | None = None,
) -> Routed:
    """One call offering the goal's `tools` and `submit_plan` (the model chooses). A plan is
    validated as with `ask_for_plan`, and an invalid or unclear first reply continues that
    conversation with `submit_plan` forced, for at most `attempts` replies in all. `on_text` is told
    the first reply's text as it is written (a goal answered in text is answered by it)."""
    request = ModelRequest(
        system=system,
        messages=[Message.user(prompt)],
        tools=[*tools, PLAN_TOOL_DEF],
        max_tokens=max_tokens,
        metadata=metadata,
    )
    response = await (model.complete(request) if on_text is None else model.complete(request, on_text))
    route = route_of(response)
    if route in ("tool", "text"):
        log.info("plan.routed", route=route, tools=[u.name for u in response.tool_uses])
        return Routed(route=route, turn=response)
    if route == "plan":
        value, problems = parse(response, PLAN_FORM, validate)
        if value is not None:
            return Routed(route="plan", outcome=FormOutcome(value=value, problems=[], attempts=1))
    else:
        problems = [PLAN_FORM.missing(response)]
    log.warning(PLAN_FORM.event, attempt=1, problems=problems)
    if attempts <= 1:
        return Routed(route="plan", outcome=FormOutcome(value=None, problems=problems, attempts=1))
    history = [response.as_message(), answer(response, PLAN_FORM, problems)] if response.content else []
    outcome = await ask_forced(
        model,
        PLAN_FORM,
        system=system,
        prompt=prompt,
        attempts=attempts - 1,
        max_tokens=max_tokens,
        metadata=metadata,
        check=validate,
        logger=log,
        history=history,
        also_offer=tools,
        asked=1,
    )
    return Routed(route="plan", outcome=outcome)
