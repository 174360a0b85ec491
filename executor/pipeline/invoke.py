"""Step 6, invoke: run the call under its timeout. Whatever goes wrong (an exception, a timeout, a
failure the tool reported, a connection lost mid-call) becomes an ERROR outcome the model can react
to; the traceback goes to the log, never to the model.

A side-effecting call is first marked started in the attempt's pending step (a crash from here on
makes it an unknown outcome, step `crash`) and claimed in the side-effect ledger (`bus.effects`);
a claim that finds a record made since `replay` looked (another attempt got there first) replays it.
Last of the checks, because running is the one thing that cannot be taken back.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, ClassVar

import structlog
from opentelemetry.trace import Span, Status, StatusCode

import bus.tracing as tracing
from bus.attempts import ToolOutcome
from bus.effects import EffectRecord

from ..sources.base import OutcomeUnknown, ToolError
from .call import Attempt, Call
from .replay import effect_key, replayed

log = structlog.get_logger("taskloom.tools")


def render(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


def trace_outcome(span: Span, outcome: ToolOutcome) -> None:
    span.set_attribute("taskloom.tool.outcome", outcome.outcome)
    if outcome.is_error:
        span.set_attribute("error.type", outcome.outcome)
        # The outcome's label only: its message may quote the arguments (personal data).
        span.set_status(Status(StatusCode.ERROR, f"tool call {outcome.outcome}"))


def effect_record(call: Call, attempt: int) -> EffectRecord:
    return EffectRecord(
        key=effect_key(call.block, call.digest),
        tool=call.block.name,
        args=dict(call.block.input),
        attempt=attempt,
        call_id=call.block.id,
    )


class Invoke:
    name: ClassVar[str] = "invoke"
    every_call: ClassVar[bool] = False

    def __init__(self, default_timeout: float, attempt: Attempt | None) -> None:
        self.default_timeout = default_timeout
        self.attempt = attempt

    async def __call__(self, call: Call) -> None:
        a, tool = self.attempt, call.tool
        assert tool is not None, "validate sets the tool of every call it lets through"
        if a is not None and tool.side_effects:
            await a.store.mark_started(call.block.id)
            if a.effects is not None and not tool.idempotent:
                earlier = await a.effects.begin(a.goal_id, a.task_id, effect_record(call, a.attempt))
                if earlier is not None:
                    log.warning("tool.side_effect_not_repeated", tool=call.block.name, earlier_attempt=earlier.attempt)
                    call.answer(replayed(call.block, earlier), "replay")
                    return
        call.traced = True
        with tracing.tool_span(call.block.name, call.block.id, call.block.input) as span:
            await self._run(call)
            assert call.outcome is not None
            trace_outcome(span, call.outcome)

    async def _run(self, call: Call) -> None:
        tool, name = call.tool, call.block.name
        assert tool is not None
        timeout = tool.timeout or self.default_timeout
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the job's own cancellation.
            async with asyncio.timeout(timeout):
                value = await tool.invoke(call.args, call.ctx)
        except TimeoutError:
            call.fail("timeout", f"tool {name} timed out after {timeout:g} s", self.name)
            return
        except asyncio.CancelledError:
            raise
        except OutcomeUnknown as exc:
            # The source lost the call midway (e.g. an MCP server died): it may have taken effect.
            log.warning("tool.outcome_unknown", tool=name, call_id=call.block.id, detail=str(exc))
            call.fail("unknown_outcome", f"tool {name}: {exc}", self.name)
            return
        except ToolError as exc:
            # A failure the tool reported itself (an MCP isError result): its words, no traceback.
            call.fail("error", f"tool {name} failed: {exc}", self.name)
            return
        except Exception as exc:
            log.warning("tool.exception", tool=name, call_id=call.block.id, exc_info=True)
            call.fail("error", f"tool {name} failed: {type(exc).__name__}: {exc}", self.name)
            return
        full = render(value)
        outcome = ToolOutcome(
            call_id=call.block.id,
            tool=name,
            outcome="ok",
            content=full,  # `truncate` cuts what the model sees; the step record keeps `full`
            full=full,
            seconds=time.perf_counter() - call.started,
        )
        call.answer(outcome, self.name)
