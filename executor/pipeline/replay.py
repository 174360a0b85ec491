"""Step 4, replay: a side-effecting call whose effect is already recorded for this task (an earlier
attempt, or earlier in this one, made the same call: same tool, same arguments) is not run again;
it gets the recorded outcome (`bus.effects`). A call whose earlier run failed (the tool said it did
nothing) passes; so does a tool declared `idempotent`, which is always run.

Before approval: a recorded effect needs no decision. Asking a person to approve a refund that was
already made, and telling the model "denied" about a refund that happened, were both wrong. This
step only reads the record; `invoke` claims it (atomically) once the call is cleared to run.
"""

from __future__ import annotations

from typing import ClassVar

import structlog

from bus.attempts import ToolOutcome
from bus.effects import EffectRecord
from llm.types import ToolUseBlock

from .call import Attempt, Call, error_outcome

log = structlog.get_logger("taskloom.tools")


def effect_key(block: ToolUseBlock, args_digest: str) -> str:
    return f"{block.name}:{args_digest}"


def replayed(call: ToolUseBlock, earlier: EffectRecord) -> ToolOutcome:
    """What a repeated side-effecting call gets instead of running again: the recorded outcome."""
    where = f"attempt {earlier.attempt}"
    if earlier.state == "ok":
        text = f"[already done in {where}; not run again] {earlier.result}"
        return ToolOutcome(call_id=call.id, tool=call.name, outcome="ok", content=text, full=text)
    return error_outcome(
        call,
        "unknown_outcome",
        f"this {call.name} call was already made in {where} and its outcome is unknown (it was interrupted); "
        "it has side effects, so it was not run again. Check its effect before retrying.",
    )


class Replay:
    name: ClassVar[str] = "replay"
    every_call: ClassVar[bool] = False

    def __init__(self, attempt: Attempt | None) -> None:
        self.attempt = attempt

    async def __call__(self, call: Call) -> None:
        a, tool = self.attempt, call.tool
        if a is None or a.effects is None or tool is None or not tool.side_effects or tool.idempotent:
            return
        earlier = await a.effects.recorded(a.goal_id, a.task_id, effect_key(call.block, call.digest))
        if earlier is None or earlier.state == "failed":
            return
        log.warning("tool.side_effect_not_repeated", tool=call.block.name, earlier_attempt=earlier.attempt)
        call.answer(replayed(call.block, earlier), self.name)
