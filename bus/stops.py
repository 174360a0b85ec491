"""Why a task attempt stopped: one enum, with each reason's meaning and the critic's feedback side
by side. The stored form (`TaskResult.stop_reason`) is the enum's value.

Adding a stop condition touches this table and the pure decision that detects it (`executor.policy`:
`stop_before_call`, `classify` for a model reply, `stop_after_tools`), nothing else: the loop acts on
any member, and the critic reads its feedback here (docs/internals.md shows an example).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class TaskStop(StrEnum):
    ANSWERED = "answered"
    MAX_STEPS = "max_steps"
    DEADLINE = "deadline"
    BUDGET_EXHAUSTED = "budget_exhausted"
    LOOP_DETECTED = "loop_detected"
    MAX_TOKENS = "max_tokens"
    REFUSAL = "refusal"
    CANCELLED = "cancelled"
    CONTEXT_FULL = "context_full"

    @classmethod
    def _missing_(cls, value: object) -> TaskStop | None:
        # Results stored under the name this reason had before carry "error".
        return cls.CONTEXT_FULL if value == "error" else None


@dataclass(frozen=True)
class StopInfo:
    meaning: str
    # What the critic tells the next attempt; None where the attempt never reaches the critic
    # (the executor ends the task or the goal itself).
    feedback: str | None


STOPS: dict[TaskStop, StopInfo] = {
    TaskStop.ANSWERED: StopInfo("the model gave its answer", None),
    TaskStop.MAX_STEPS: StopInfo(
        "the attempt used all its steps (max_steps) without answering",
        "the previous attempt used all its steps without answering; work more directly and answer sooner",
    ),
    TaskStop.DEADLINE: StopInfo(
        "the attempt's time limit passed before an answer",
        "the previous attempt ran out of time before answering; do less and answer sooner",
    ),
    TaskStop.BUDGET_EXHAUSTED: StopInfo("the goal's token budget cannot pay for the next model call", None),
    TaskStop.LOOP_DETECTED: StopInfo(
        "the model repeated an identical tool call after being warned",
        "the previous attempt repeated the same tool call in a loop; change approach instead",
    ),
    TaskStop.MAX_TOKENS: StopInfo(
        "the answer was cut off at the output limit twice",
        "the previous answer was cut off at the output limit; answer more briefly",
    ),
    TaskStop.REFUSAL: StopInfo(
        "the model refused", "the previous attempt was refused by the model; rephrase the work within policy"
    ),
    TaskStop.CANCELLED: StopInfo("the task was cancelled or superseded", None),
    TaskStop.CONTEXT_FULL: StopInfo(
        "the conversation no longer fits the model's context window",
        "the previous attempt's conversation outgrew the model's context window; "
        "ask tools for less output and answer in fewer steps",
    ),
}


def critic_feedback(reason: TaskStop) -> str:
    """What the critic tells the next attempt about an attempt that stopped without an answer."""
    return STOPS[reason].feedback or f"the previous attempt stopped ({reason.value})"
