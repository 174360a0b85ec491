"""The tool-source contract: what the gateway needs of a tool, whichever source it comes from.

A source is entered once per worker process (`async with source:`), lists its tools
(`list_tools`, which may be cached) and is the only way a call of one of its tools reaches the
outside world (`CatalogTool.invoke` delegates to its source). Sources never decide policy: the
flags a tool carries (`read_only`, `side_effects`, `requires_approval`, `timeout`) are read and
enforced by the gateway and the loop, the same for every source.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from llm.types import ToolDef


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about the call that runs it."""

    goal_id: str
    task_id: str
    attempt: int
    step: int
    call_id: str
    tool: str = ""
    args_digest: str = ""

    @property
    def idempotency_key(self) -> str:
        """Stable across the task's attempts for the same call (tool and arguments), so that a
        downstream service dedupes it too; per call when the tool and arguments are not known."""
        if self.tool:
            return f"{self.goal_id}:{self.task_id}:{self.tool}:{self.args_digest}"
        return f"{self.goal_id}:{self.task_id}:{self.attempt}:{self.step}:{self.call_id}"


class InvalidArguments(ValueError):
    """The model's arguments do not fit the tool's input schema; the message lists every problem."""


class ToolError(Exception):
    """The tool ran and reported a failure (an MCP `isError` result, a server that is down).
    The message is shown to the model as is, after `ERROR: tool <name> failed: `."""


class OutcomeUnknown(ToolError):
    """The call may or may not have taken effect (the connection was lost while it ran). For a tool
    with side effects the model is told so, and the call is never retried automatically."""


@runtime_checkable
class CatalogTool(Protocol):
    """One tool as the gateway sees it."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def read_only(self) -> bool: ...  # may run concurrently with other read-only calls

    @property
    def side_effects(self) -> bool: ...  # never run twice for one call

    @property
    def requires_approval(self) -> bool: ...  # a person approves each call

    @property
    def idempotent(self) -> bool: ...  # a side_effects tool that is safe to repeat (run again, not replayed)

    @property
    def timeout(self) -> float | None: ...  # seconds; None = the gateway's default

    @property
    def definition(self) -> ToolDef: ...

    def parse(self, arguments: dict[str, Any]) -> Any:
        """The validated arguments; raises `InvalidArguments` naming every problem."""
        ...

    async def invoke(self, args: Any, ctx: ToolContext) -> Any:
        """Run the call with arguments from `parse`. Raises on failure (the gateway reports it)."""
        ...


class ToolSource(Protocol):
    """A place tools come from, entered as an async context manager for the worker's lifetime."""

    @property
    def label(self) -> str: ...  # for messages: "toolkit 'support'", "MCP server 'desk'"

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def list_tools(self) -> list[CatalogTool]:
        """The source's tools now (a source may serve this from a short-lived cache)."""
        ...

    async def call_tool(self, name: str, args: Any, ctx: ToolContext) -> Any:
        """Run one already validated call of the tool `name` (the source's own name for it)."""
        ...
