"""The tool gateway: the one place every tool call passes, and where tool policy lives.

Whatever goes wrong with a call (a tool that is not allowed or does not exist, invalid arguments,
an exception, a timeout) becomes an `ERROR: ...` observation with `is_error`, which the model can
react to; it never crashes the loop. The full traceback goes to the log, never to the model.

Tools come from several sources (`executor.sources`: Python toolkits, MCP servers); the gateway
sees one registry and applies one policy to all of them. A source only ever runs a call that the
gateway validated and handed to `invoke`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

import structlog
from opentelemetry.trace import Span, Status, StatusCode

import bus.tracing as tracing
from bus.attempts import Outcome, ToolOutcome
from bus.events import EventLog
from bus.observe import observe
from bus.schemas import Event
from llm.types import ToolDef, ToolUseBlock

from .registry import ToolRegistry
from .sources.base import CatalogTool, InvalidArguments, OutcomeUnknown, ToolContext, ToolError

log = structlog.get_logger("taskloom.tools")


def render(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def truncate(text: str, limit: int) -> str:
    """Cut `text` to `limit` characters, saying how much was cut (so the model knows it is partial)."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"{text[:limit]}\n[... truncated: {cut} of {len(text)} characters not shown]"


def digest(args: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:16]


def error_outcome(call: ToolUseBlock, outcome: Outcome, message: str, seconds: float = 0.0) -> ToolOutcome:
    text = f"ERROR: {message}"
    return ToolOutcome(call_id=call.id, tool=call.name, outcome=outcome, content=text, full=text, seconds=seconds)


def _trace_outcome(span: Span, outcome: ToolOutcome) -> None:
    span.set_attribute("taskloom.tool.outcome", outcome.outcome)
    if outcome.is_error:
        span.set_attribute("error.type", outcome.outcome)
        # The outcome's label only: its message may quote the arguments (personal data).
        span.set_status(Status(StatusCode.ERROR, f"tool call {outcome.outcome}"))


class ToolGateway:
    def __init__(
        self,
        registry: ToolRegistry,
        allowed: Iterable[str],
        events: EventLog | None = None,
        *,
        output_limit: int = 4000,
        default_timeout: float = 30.0,
    ) -> None:
        self.registry = registry
        self.allowed = sorted(set(allowed) & set(registry.names()))
        self.events = events
        self.output_limit = output_limit
        self.default_timeout = default_timeout
        self._traced: set[str] = set()  # call ids whose span `invoke` opened

    @staticmethod
    def allowed_for(goal_tools: Iterable[str] | None, task_tools: Iterable[str]) -> set[str]:
        """Tools a task may use: those its spec names that the goal also allows (None = all)."""
        task = set(task_tools)
        return task if goal_tools is None else task & set(goal_tools)

    def definitions(self) -> list[ToolDef]:
        return self.registry.definitions(self.allowed)

    def tool(self, name: str) -> CatalogTool | None:
        return self.registry.get(name) if name in self.allowed else None

    def validate(self, call: ToolUseBlock) -> tuple[CatalogTool, Any] | ToolOutcome:
        """The tool and its validated arguments, or the ERROR outcome the model should see."""
        if call.name not in self.allowed:
            listed = ", ".join(self.allowed) or "(none)"
            if call.name in self.registry:
                return error_outcome(call, "not_allowed", f"tool {call.name!r} is not allowed; available: {listed}")
            return error_outcome(call, "unknown_tool", f"unknown tool {call.name!r}; available: {listed}")
        tool = self.registry.tools[call.name]
        try:
            args = tool.parse(call.input)
        except InvalidArguments as exc:
            return error_outcome(call, "invalid_args", f"invalid arguments for {call.name}: {exc}")
        return tool, args

    async def run(self, call: ToolUseBlock, ctx: ToolContext) -> ToolOutcome:
        """Validate and run one call, audit it, and turn any failure into an ERROR observation."""
        started = time.perf_counter()
        checked = self.validate(call)
        if isinstance(checked, ToolOutcome):
            outcome = checked
        else:
            tool, args = checked
            outcome = await self.invoke(call, tool, args, ctx, started)
        await self.audit(call, outcome, ctx)
        return outcome

    async def invoke(
        self, call: ToolUseBlock, tool: CatalogTool, args: Any, ctx: ToolContext, started: float | None = None
    ) -> ToolOutcome:
        """Run an already validated call; failures become ERROR outcomes (not audited here)."""
        self._traced.add(call.id)
        with tracing.tool_span(call.name, call.id, call.input) as span:
            outcome = await self._invoke(call, tool, args, ctx, started)
            _trace_outcome(span, outcome)
        return outcome

    async def _invoke(
        self, call: ToolUseBlock, tool: CatalogTool, args: Any, ctx: ToolContext, started: float | None
    ) -> ToolOutcome:
        started = time.perf_counter() if started is None else started
        timeout = tool.timeout or self.default_timeout
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the job's own cancellation.
            async with asyncio.timeout(timeout):
                value = await tool.invoke(args, ctx)
        except TimeoutError:
            return error_outcome(
                call, "timeout", f"tool {call.name} timed out after {timeout:g} s", time.perf_counter() - started
            )
        except asyncio.CancelledError:
            raise
        except OutcomeUnknown as exc:
            # The source lost the call midway (e.g. an MCP server died): it may have taken effect.
            log.warning("tool.outcome_unknown", tool=call.name, call_id=call.id, detail=str(exc))
            return error_outcome(call, "unknown_outcome", f"tool {call.name}: {exc}", time.perf_counter() - started)
        except ToolError as exc:
            # A failure the tool reported itself (an MCP isError result): its words, no traceback.
            return error_outcome(call, "error", f"tool {call.name} failed: {exc}", time.perf_counter() - started)
        except Exception as exc:
            log.warning("tool.exception", tool=call.name, call_id=call.id, exc_info=True)
            return error_outcome(
                call, "error", f"tool {call.name} failed: {type(exc).__name__}: {exc}", time.perf_counter() - started
            )
        full = render(value)
        return ToolOutcome(
            call_id=call.id,
            tool=call.name,
            outcome="ok",
            content=truncate(full, self.output_limit),
            full=full,
            seconds=time.perf_counter() - started,
        )

    async def audit(
        self, call: ToolUseBlock, outcome: ToolOutcome, ctx: ToolContext, emit: bool = True
    ) -> Event | None:
        """One event per call on the goal's stream: tool, argument digest, duration, outcome.

        `emit=False`: the caller appends the returned event itself (the loop stores it with the
        outcome, in one script); None when this gateway has no event log."""
        data = {
            "call_id": call.id,
            "tool": call.name,
            "args_digest": digest(call.input),
            "seconds": round(outcome.seconds, 4),
            "outcome": outcome.outcome,
            "attempt": ctx.attempt,
            "step": ctx.step,
        }
        log.info("tool.call", **data)
        if call.id not in self._traced:
            # Refused before it ran (not allowed, invalid arguments, denied, a repeat): still one span per call.
            with tracing.tool_span(call.name, call.id, call.input) as span:
                _trace_outcome(span, outcome)
        # A name the model invented is not a label value (unbounded): it is counted as "(unknown)".
        tool = call.name if outcome.outcome != "unknown_tool" else "(unknown)"
        observe(lambda o: o.tool_call(tool, outcome.outcome, outcome.seconds))
        if self.events is None:
            return None
        event = Event(type="tool.call", goal_id=ctx.goal_id, task_id=ctx.task_id, data=data)
        if emit:
            await self.events.emit(event)
        return event
