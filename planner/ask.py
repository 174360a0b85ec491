"""The planning conversation: ask for `submit_plan`, send an invalid plan back with its problems.

The protocol (docs/internals.md, "The model protocol", and `llm.forced`): the planner forces the
`submit_plan` tool; its input is a `Plan`. An invalid plan is answered by a `tool_result` with
`is_error=true` listing every problem, and the model tries again, at most `attempts` times in all.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from bus.schemas import Plan, json_schema
from llm.forced import FormOutcome, FormSpec, ask_forced
from llm.port import ModelPort
from llm.types import ModelResponse, ToolDef

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
