"""Step 2, repeats: the loop policy. An identical call (same tool, same arguments) within the last
`loop_window` calls of the attempt is a loop when the earlier one *succeeded* (its result will not
change): the first such repeat is answered with a warning (`repeated`), the next ends the attempt
(`loop`). A call whose earlier identical calls failed (an error, a timeout, an isError result, an
unknown outcome) is run again, up to `tool_error_retries` times; past that it is a repeat like any
other.

Second, right after validate: it needs the tool's name and arguments, and it must answer before
anything slow or irreversible is even looked at. It sits before replay and approval so that a model
stuck on one call is stopped without a person being asked about each repeat; a side-effecting call
it lets through still meets the replay step, so a retry never repeats a recorded effect.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from bus.attempts import Pending, StepRecord, ToolOutcome
from llm.types import ToolUseBlock

from .call import Attempt, Call, digest

# Outcomes after which an identical retry may help: the call failed, or may not have happened.
FAILED = frozenset({"error", "timeout", "unknown_outcome", "cancelled"})
# Outcomes of calls that never passed validate (they are not remembered here).
REFUSED = frozenset({"not_allowed", "unknown_tool", "invalid_args"})

REPEAT_ERROR = (
    "you already called {tool} with exactly these arguments in this task; the result will not "
    "change. Use the earlier result or try something different. Repeating it again ends the task."
)
RETRIES_ERROR = (
    "{tool} with exactly these arguments failed {failures} times in this task; it is not run again. "
    "Try something different. Repeating it again ends the task."
)
LOOP_ERROR = "{tool} was repeated with exactly the same arguments after a warning: the task stops here (a loop)."


@dataclass
class Seen:
    """One call the policy has seen: `outcome` None while it runs."""

    tool: str
    digest: str
    outcome: str | None = None


@dataclass
class History:
    """The calls of one attempt that passed validate, oldest first; rebuilt from the stored steps
    after a crash, so the policy decides the same way on a resumed attempt."""

    seen: list[Seen] = field(default_factory=list)
    warned: bool = False  # a repeat warning was given in this attempt

    @classmethod
    def rebuild(cls, steps: Sequence[StepRecord], pending: Pending | None = None) -> History:
        history = cls()
        for step in steps:
            history._add(step.assistant.content, {o.call_id: o for o in step.outcomes})
            history.warned = history.warned or "repeat" in step.notes  # steps stored by older workers
        if pending is not None and pending.turn is not None:
            history._add(pending.turn.content, pending.results)  # the calls answered before a crash
        return history

    def _add(self, blocks: Iterable[object], outcomes: Mapping[str, ToolOutcome]) -> None:
        for block in blocks:
            if not isinstance(block, ToolUseBlock) or block.id not in outcomes:
                continue
            outcome = outcomes[block.id].outcome
            if outcome in REFUSED:
                continue
            self.warned = self.warned or outcome in ("repeated", "loop")
            self.seen.append(Seen(block.name, digest(block.input), outcome))


Decision = Literal["run", "warn", "stop"]


def decide(seen: Sequence[Seen], tool: str, args_digest: str, window: int, retries: int, warned: bool) -> Decision:
    """Whether a call may run, given the calls seen before it (pure)."""
    same = [s for s in seen[-window:] if (s.tool, s.digest) == (tool, args_digest)]
    if not same:
        return "run"
    if same[-1].outcome in FAILED and sum(1 for s in same if s.outcome in FAILED) <= retries:
        return "run"
    return "stop" if warned else "warn"


class Repeats:
    name: ClassVar[str] = "repeats"
    every_call: ClassVar[bool] = False

    def __init__(self, attempt: Attempt | None, window: int, retries: int) -> None:
        self.attempt = attempt
        self.window = window
        self.retries = retries

    async def __call__(self, call: Call) -> None:
        if self.attempt is None:
            return
        history, tool, args = self.attempt.history, call.block.name, call.digest
        verdict = decide(history.seen, tool, args, self.window, self.retries, history.warned)
        # Remembered before it runs: an identical call later in the same turn sees it running, and
        # is a repeat (its twin's result is on its way).
        call.seen = Seen(tool, args)
        history.seen.append(call.seen)
        if verdict == "run":
            return
        if verdict == "stop":
            call.fail("loop", LOOP_ERROR.format(tool=tool), self.name)
            return
        history.warned = True
        failures = [s for s in history.seen[-self.window - 1 : -1] if (s.tool, s.digest) == (tool, args)]
        if failures and failures[-1].outcome in FAILED:
            call.fail("repeated", RETRIES_ERROR.format(tool=tool, failures=len(failures)), self.name)
        else:
            call.fail("repeated", REPEAT_ERROR.format(tool=tool), self.name)
