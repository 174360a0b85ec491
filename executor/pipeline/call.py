"""What every step of the tool-call pipeline shares: the call in flight (`Call`), the step shape
(`Step`), the attempt a call belongs to (`Attempt`) and the ERROR observation (`error_outcome`)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from bus.attempts import Outcome, ToolOutcome
from llm.types import ToolUseBlock

from ..sources.base import CatalogTool, ToolContext

if TYPE_CHECKING:
    from bus.attempts import AttemptStore
    from bus.effects import SideEffects

    from .approval import Approvals
    from .repeats import History, Seen


def digest(args: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:16]


def error_outcome(call: ToolUseBlock, outcome: Outcome, message: str, seconds: float = 0.0) -> ToolOutcome:
    text = f"ERROR: {message}"
    return ToolOutcome(call_id=call.id, tool=call.name, outcome=outcome, content=text, full=text, seconds=seconds)


@dataclass
class Call:
    """One tool call on its way through the pipeline. Steps fill it in: `validate` sets `tool` and
    `args`; the step that answers the call sets `outcome` (and `answered_by`, its name)."""

    block: ToolUseBlock
    ctx: ToolContext
    tool: CatalogTool | None = None
    args: Any = None
    outcome: ToolOutcome | None = None
    answered_by: str = ""
    started: float = field(default_factory=time.perf_counter)
    traced: bool = False  # `invoke` opened the call's span (a refused call gets one when recorded)
    seen: Seen | None = None  # its entry in the repeat history, updated when the call is answered

    @property
    def digest(self) -> str:
        return digest(self.block.input)

    def answer(self, outcome: ToolOutcome, by: str) -> None:
        self.outcome, self.answered_by = outcome, by
        if self.seen is not None:
            self.seen.outcome = outcome.outcome

    def fail(self, kind: Outcome, message: str, by: str) -> None:
        """Answer with an ERROR observation."""
        self.answer(error_outcome(self.block, kind, message, time.perf_counter() - self.started), by)


class Step(Protocol):
    """One rule of the pipeline. A step may answer the call (`Call.answer`); the steps after it then
    skip the call, except those with `every_call` (truncate, record), which see every answer."""

    name: ClassVar[str]
    every_call: ClassVar[bool]

    async def __call__(self, call: Call) -> None: ...


@dataclass
class Attempt:
    """The task attempt whose calls the pipeline runs, and the services its steps write through.

    A gateway used on its own (no attempt: the source tests, a tool tried by hand) applies only
    validate, invoke, truncate and record; the rules that need an attempt's memory or Redis (repeats,
    crash, replay, approval) pass every call."""

    goal_id: str
    task_id: str
    attempt: int
    store: AttemptStore
    history: History
    approvals: Approvals | None = None
    effects: SideEffects | None = None
    started: set[str] = field(default_factory=set)  # calls marked started before a crash (no result)
