"""What the store keeps in process memory: records that never change once stored, and the goal
record a job's wrapper just read, handed to the job's own first read.
"""

from __future__ import annotations

import contextvars
import time
from collections import OrderedDict
from typing import Any

from .schemas import GoalRecord

# A goal's deadline (part of its immutable record) and each plan version (never overwritten) are
# remembered. Bounded; the oldest entries go first.
MEMO_SIZE = 2048

# The goal record the job wrapper's `expire_if_late(..., hand_over=True)` just read, for the next
# `get_goal` of the same job, if it comes within HAND_OVER_S (a context variable: each arq job runs
# in its own task, so jobs never see each other's); with it, when the wrapper was told the job's
# task, that task's hash as read in the same round trip (for `get_goal_and_task`).
_JUST_READ: contextvars.ContextVar[tuple[str, GoalRecord, float, tuple[str, Any] | None] | None] = (
    contextvars.ContextVar("taskloom_goal_just_read", default=None)
)
HAND_OVER_S = 0.5


class Memo(OrderedDict[Any, Any]):
    """A bounded map of values that never change once stored; the least recently put go first."""

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > MEMO_SIZE:
            self.popitem(last=False)


def hand_over_goal(goal: GoalRecord, task: tuple[str, Any] | None = None) -> None:
    """Keep `goal`, read an instant ago, for the next `take_handed_over` of the same job; `task`:
    (task id, its hash as read in the same round trip), for `take_handed_over_with_task`."""
    _JUST_READ.set((goal.id, goal, time.monotonic(), task))


def is_handed_over(goal_id: str) -> bool:
    """Whether the job holds a handed-over record of `goal_id` (fresh or not)."""
    held = _JUST_READ.get()
    return held is not None and held[0] == goal_id


def take_handed_over(goal_id: str) -> GoalRecord | None:
    """The handed-over record of `goal_id` if it is fresh; any hand-over is used once."""
    held = _JUST_READ.get()
    if held is None:
        return None
    _JUST_READ.set(None)  # once: a later read in the same job goes to Redis again
    if held[0] == goal_id and time.monotonic() - held[2] < HAND_OVER_S:
        return held[1]
    return None


def take_handed_over_with_task(goal_id: str, task_id: str) -> tuple[GoalRecord, Any] | None:
    """The handed-over goal and the raw hash of its task `task_id`, read together, if both were
    handed over and are fresh; else None, and the hand-over is left for `take_handed_over`."""
    held = _JUST_READ.get()
    if held is None or held[0] != goal_id or held[3] is None or held[3][0] != task_id:
        return None
    if time.monotonic() - held[2] >= HAND_OVER_S:
        return None
    _JUST_READ.set(None)
    return held[1], held[3][1]
