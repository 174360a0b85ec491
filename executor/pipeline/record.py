"""Step 8, record and audit: every call, however it was answered, is stored and audited once.

With an attempt: the outcome goes into the attempt's pending step together with its `tool.call`
event (one script: a crash later keeps both, and a resumed attempt does not run the call again),
and a side-effecting call that ran has its ending written to the side-effect ledger (`ok`, `failed`
when the tool reported an error, `unknown` after a timeout or a lost connection). Without one, the
event goes to the goal's stream directly. Every call also gets a log line, a metric and, when
nothing ran (refused, replayed, denied), the span `invoke` would have opened.

Last: it records the answer the model will see, after every rule has had its say.
"""

from __future__ import annotations

from typing import ClassVar

import structlog

import bus.tracing as tracing
from bus.effects import RESULT_LIMIT, EffectState
from bus.events import EventLog
from bus.observe import observe
from bus.schemas import Event

from .call import Attempt, Call
from .invoke import effect_record, trace_outcome

log = structlog.get_logger("taskloom.tools")

EFFECT_STATE: dict[str, EffectState] = {
    "ok": "ok",
    "error": "failed",
    "timeout": "unknown",
    "cancelled": "unknown",
    "unknown_outcome": "unknown",
}


class Record:
    name: ClassVar[str] = "record"
    every_call: ClassVar[bool] = True

    def __init__(self, events: EventLog | None, attempt: Attempt | None) -> None:
        self.events = events
        self.attempt = attempt

    async def __call__(self, call: Call) -> None:
        outcome, a = call.outcome, self.attempt
        assert outcome is not None, "invoke answers every call no earlier step answered"
        if a is not None and a.effects is not None and call.answered_by == "invoke":
            tool = call.tool
            if tool is not None and tool.side_effects:
                state = EFFECT_STATE.get(outcome.outcome, "failed")
                ended = effect_record(call, a.attempt).model_copy(
                    update={"state": state, "result": outcome.full[:RESULT_LIMIT]}
                )
                await a.effects.finish(a.goal_id, a.task_id, ended)
        event = self.audit(call)
        if a is not None:
            await a.store.save_outcome(outcome, event)
        elif event is not None and self.events is not None:
            await self.events.emit(event)

    def audit(self, call: Call) -> Event | None:
        """The call's `tool.call` event (tool, argument digest, duration, outcome, the step that
        answered it), log line, metric and span; None when there is no event log to write it to."""
        outcome, ctx = call.outcome, call.ctx
        assert outcome is not None
        data = {
            "call_id": call.block.id,
            "tool": call.block.name,
            "args_digest": call.digest,
            "seconds": round(outcome.seconds, 4),
            "outcome": outcome.outcome,
            "answered_by": call.answered_by,
            "attempt": ctx.attempt,
            "step": ctx.step,
        }
        log.info("tool.call", **data)
        if not call.traced:
            with tracing.tool_span(call.block.name, call.block.id, call.block.input) as span:
                trace_outcome(span, outcome)
        # A name the model invented is not a label value (unbounded): it is counted as "(unknown)".
        tool = call.block.name if outcome.outcome != "unknown_tool" else "(unknown)"
        observe(lambda o: o.tool_call(tool, outcome.outcome, outcome.seconds))
        if self.events is None and self.attempt is None:
            return None
        return Event(type="tool.call", goal_id=ctx.goal_id, task_id=ctx.task_id, data=data)
