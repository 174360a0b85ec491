"""Model calls of the critic: a forced `submit_verdict` (with one correction), and the final answer."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from pydantic import ValidationError

from bus.schemas import Verdict
from llm.port import ModelPort
from llm.types import ContentBlock, Message, ModelRequest, ModelResponse, TextBlock, ToolChoice, ToolResultBlock

from .prompts import VERDICT_TOOL, VERDICT_TOOL_DEF, verdict_correction

log = structlog.get_logger("taskloom.critic")

# The first reply, then one corrective turn: a reviewer that cannot fill a 3-field form twice will
# not manage a third time, and the task is retried instead.
VERDICT_ATTEMPTS = 2


@dataclass(frozen=True)
class VerdictOutcome:
    verdict: Verdict | None
    problems: list[str]


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "verdict"
        out.append(f"{where}: {err['msg']}.")
    return out


def _parse(response: ModelResponse) -> tuple[Verdict | None, list[str]]:
    uses = [u for u in response.tool_uses if u.name == VERDICT_TOOL]
    if not uses:
        return None, ["the reply did not call submit_verdict"]
    try:
        return Verdict.model_validate(uses[0].input), []
    except ValidationError as exc:
        return None, _problems(exc)


def _answer(response: ModelResponse, problems: list[str]) -> Message:
    """Every tool_use answered by a tool_result (the API requires it), the verdict's one with the problems."""
    uses = response.tool_uses
    target = next((u.id for u in uses if u.name == VERDICT_TOOL), uses[0].id if uses else None)
    content: list[ContentBlock] = [
        ToolResultBlock(
            tool_use_id=u.id,
            content=verdict_correction(problems) if u.id == target else "Ignored: call submit_verdict once.",
            is_error=True,
        )
        for u in uses
    ]
    return Message(role="user", content=content or [TextBlock(text=verdict_correction(problems))])


async def ask_for_verdict(
    model: ModelPort, *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> VerdictOutcome:
    """The verdict the model submits, after at most one correction; raises what the model raises."""
    messages = [Message.user(prompt)]
    problems: list[str] = []
    for attempt in range(1, VERDICT_ATTEMPTS + 1):
        response = await model.complete(
            ModelRequest(
                system=system,
                messages=messages,
                tools=[VERDICT_TOOL_DEF],
                tool_choice=ToolChoice.force(VERDICT_TOOL),
                max_tokens=max_tokens,
                metadata=metadata,
            )
        )
        verdict, problems = _parse(response)
        if verdict is not None:
            return VerdictOutcome(verdict=verdict, problems=[])
        log.warning("verdict.invalid", attempt=attempt, problems=problems)
        if response.content:
            messages = [*messages, response.as_message(), _answer(response, problems)]
    return VerdictOutcome(verdict=None, problems=problems)


async def write_answer(
    model: ModelPort, *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> ModelResponse:
    """One plain-text turn (no tools): the goal's final answer is its text."""
    return await model.complete(
        ModelRequest(system=system, messages=[Message.user(prompt)], max_tokens=max_tokens, metadata=metadata)
    )
