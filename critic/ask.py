"""Model calls of the critic: a forced `submit_verdict` or `submit_final` (each with one correction)."""

from __future__ import annotations

from typing import TypeVar

import structlog
from pydantic import BaseModel

from bus.schemas import FinalVerdict, Verdict
from llm.forced import FormOutcome, FormSpec, ask_forced
from llm.port import ModelPort

from .prompts import FINAL_TOOL_DEF, VERDICT_TOOL_DEF, final_correction, verdict_correction

log = structlog.get_logger("taskloom.critic")

T = TypeVar("T", bound=BaseModel)

# The first reply, then one corrective turn: a reviewer that cannot fill a 3-field form twice will
# not manage a third time, and the task is retried instead.
VERDICT_ATTEMPTS = 2

VERDICT_FORM = FormSpec(
    tool=VERDICT_TOOL_DEF,
    schema=Verdict,
    correction=verdict_correction,
    missing=lambda _response: "the reply did not call submit_verdict",
    ignored="Ignored: call submit_verdict once.",
    root="verdict",
    event="verdict.invalid",
)


FINAL_FORM = FormSpec(
    tool=FINAL_TOOL_DEF,
    schema=FinalVerdict,
    correction=final_correction,
    missing=lambda _response: "the reply did not call submit_final",
    ignored="Ignored: call submit_final once.",
    root="final",
    event="final.invalid",
)


async def _ask(
    model: ModelPort, form: FormSpec[T], *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> FormOutcome[T]:
    """What the model submits through `form` (`llm.forced`), after at most one correction; raises
    what the model raises."""
    return await ask_forced(
        model,
        form,
        system=system,
        prompt=prompt,
        attempts=VERDICT_ATTEMPTS,
        max_tokens=max_tokens,
        metadata=metadata,
        logger=log,
    )


async def ask_for_verdict(
    model: ModelPort, *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> FormOutcome[Verdict]:
    """The verdict on one task attempt."""
    return await _ask(model, VERDICT_FORM, system=system, prompt=prompt, max_tokens=max_tokens, metadata=metadata)


async def ask_for_final(
    model: ModelPort, *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> FormOutcome[FinalVerdict]:
    """The final answer and its verdict, in one forced call."""
    return await _ask(model, FINAL_FORM, system=system, prompt=prompt, max_tokens=max_tokens, metadata=metadata)
