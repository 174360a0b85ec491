"""Model calls of the critic: a verdict as a JSON reply, or a forced `submit_final` (each with one correction)."""

from __future__ import annotations

import structlog

from bus.schemas import FinalVerdict, Verdict
from llm.forced import FormOutcome, FormSpec, ask_forced
from llm.jsonform import JsonForm, ask_json
from llm.port import ModelPort

from .prompts import FINAL_TOOL_DEF, final_correction, verdict_correction

log = structlog.get_logger("taskloom.critic")

# The first reply, then one corrective turn: a reviewer that cannot fill a 3-field form twice will
# not manage a third time, and the task is retried instead.
VERDICT_ATTEMPTS = 2

VERDICT_FORM = JsonForm(schema=Verdict, correction=verdict_correction, root="verdict", event="verdict.invalid")


FINAL_FORM = FormSpec(
    tool=FINAL_TOOL_DEF,
    schema=FinalVerdict,
    correction=final_correction,
    missing=lambda _response: "the reply did not call submit_final",
    ignored="Ignored: call submit_final once.",
    root="final",
    event="final.invalid",
)


async def ask_for_verdict(
    model: ModelPort, *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> FormOutcome[Verdict]:
    """The verdict on one task attempt, as a JSON reply."""
    return await ask_json(
        model,
        VERDICT_FORM,
        system=system,
        prompt=prompt,
        attempts=VERDICT_ATTEMPTS,
        max_tokens=max_tokens,
        metadata=metadata,
        logger=log,
    )


async def ask_for_final(
    model: ModelPort, *, system: str, prompt: str, max_tokens: int, metadata: dict[str, str]
) -> FormOutcome[FinalVerdict]:
    """The final answer and its verdict, in one forced call."""
    return await ask_forced(
        model,
        FINAL_FORM,
        system=system,
        prompt=prompt,
        attempts=VERDICT_ATTEMPTS,
        max_tokens=max_tokens,
        metadata=metadata,
        logger=log,
    )
