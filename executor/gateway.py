"""The tool gateway: the one place every tool call passes, whatever its source (Python toolkits,
MCP servers), through one ordered pipeline of named steps (`executor.pipeline`, a module each):

    validate -> repeats -> crash -> replay -> approval -> invoke -> truncate -> record

1. validate  the tool exists, the task may use it, the arguments are a JSON object fitting its schema
2. repeats   the loop policy: a repeat of a call that succeeded is a loop; a failed one may be retried
3. crash     a side-effecting call that started before a crash gets an unknown outcome, not a re-run
4. replay    a side-effecting call whose effect is recorded for the task gets the recorded outcome
5. approval  a `requires_approval` call waits for a person (`Paused`); a denied one never runs
6. invoke    mark started, claim the side effect, run under the timeout; failures become ERRORs
7. truncate  what the model sees is cut to `output_limit` characters
8. record    stored with the attempt's step and audited (event, log, metric, span)

A step may answer the call (an ERROR, a replay, ...); the checks after it are then skipped, but
truncate and record see every call. Each step's module says why it sits where it does. A new rule
(say a per-tool rate limit) is one new step put in its place in `ToolGateway.__init__`; the loop
(`executor.loop`) only decides which calls of a turn run together and never sees a rule.
"""

from __future__ import annotations

from collections.abc import Iterable

from bus.attempts import Pending, StepRecord, ToolOutcome
from bus.events import EventLog
from bus.runtime import DEFAULT_LIMITS
from llm.types import ToolDef, ToolUseBlock

from .pipeline import (
    Approval,
    Attempt,
    Call,
    History,
    Invoke,
    Record,
    Repeats,
    Replay,
    Step,
    Truncate,
    UnknownAfterCrash,
    Validate,
    digest,
    error_outcome,
    truncate,
)
from .registry import ToolRegistry
from .sources.base import CatalogTool, ToolContext

__all__ = ["ToolGateway", "digest", "error_outcome", "truncate"]


class ToolGateway:
    def __init__(
        self,
        registry: ToolRegistry,
        allowed: Iterable[str],
        events: EventLog | None = None,
        *,
        output_limit: int = DEFAULT_LIMITS.tool_output_limit,
        default_timeout: float = DEFAULT_LIMITS.tool_timeout,
        attempt: Attempt | None = None,
        loop_window: int = DEFAULT_LIMITS.loop_window,
        error_retries: int = DEFAULT_LIMITS.tool_error_retries,
    ) -> None:
        self.registry = registry
        self.allowed = sorted(set(allowed) & set(registry.names()))
        self.attempt = attempt
        self.steps: tuple[Step, ...] = (
            Validate(registry, self.allowed),
            Repeats(attempt, loop_window, error_retries),
            UnknownAfterCrash(attempt),
            Replay(attempt),
            Approval(attempt),
            Invoke(default_timeout, attempt),
            Truncate(output_limit),
            Record(events, attempt),
        )

    @staticmethod
    def allowed_for(goal_tools: Iterable[str] | None, task_tools: Iterable[str]) -> set[str]:
        """Tools a task may use: those its spec names that the goal also allows (None = all)."""
        task = set(task_tools)
        return task if goal_tools is None else task & set(goal_tools)

    def definitions(self) -> list[ToolDef]:
        return self.registry.definitions(self.allowed)

    def tool(self, name: str) -> CatalogTool | None:
        return self.registry.get(name) if name in self.allowed else None

    def read_only(self, name: str) -> bool:
        """Whether a call of `name` may run concurrently with the turn's other read-only calls."""
        tool = self.tool(name)
        return tool is not None and tool.read_only

    def resume(self, steps: list[StepRecord], pending: Pending) -> None:
        """Where the attempt stands (after a crash or a pause): the calls the repeat policy has seen
        and the side-effecting calls that started without a result."""
        if self.attempt is None:
            return
        rebuilt = History.rebuild(steps, pending)
        self.attempt.history.seen[:] = rebuilt.seen
        self.attempt.history.warned = rebuilt.warned
        self.attempt.started = set(pending.started) - set(pending.results)

    async def run(self, block: ToolUseBlock, ctx: ToolContext) -> ToolOutcome:
        """Pass one call through every step, in order; returns what the model sees. Raises
        `Paused` when the call awaits a person's approval (nothing was recorded for it)."""
        call = Call(block, ctx)
        for step in self.steps:
            if call.outcome is None or step.every_call:
                await step(call)
        assert call.outcome is not None
        return call.outcome

