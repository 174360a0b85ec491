"""Step 7, truncate: what the model sees of any answer is at most `output_limit` characters, with a
note saying how much was cut; the step record keeps the whole output (`ToolOutcome.full`).

After invoke (it shapes the answer, whichever step gave it), before record (the stored observation
is the one the model saw).
"""

from __future__ import annotations

from typing import ClassVar

from .call import Call


def truncate(text: str, limit: int) -> str:
    """Cut `text` to `limit` characters, saying how much was cut (so the model knows it is partial)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"{text[:limit]}\n[... truncated: {cut} of {len(text)} characters not shown]"


class Truncate:
    name: ClassVar[str] = "truncate"
    every_call: ClassVar[bool] = True

    def __init__(self, limit: int) -> None:
        self.limit = limit

    async def __call__(self, call: Call) -> None:
        outcome = call.outcome
        if outcome is not None and len(outcome.content) > self.limit:
            call.outcome = outcome.model_copy(update={"content": truncate(outcome.content, self.limit)})
