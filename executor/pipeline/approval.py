"""Step 5, approval: a `requires_approval` call runs only once a person approved it. Undecided: the
request is stored (with how the task's earlier calls of that tool ended, so the person sees what
already happened) and the attempt pauses (`Paused`); denied: the call never ran, and the model is
told so.

After validate, repeats, crash and replay: a person is asked only about a call that would really
run now, never about one the rules answer anyway (a loop, an unknown outcome, an effect already
recorded). Before invoke, naturally.
"""

from __future__ import annotations

from typing import ClassVar

from bus.approvals import ApprovalBook, ApprovalDecision
from bus.schemas import Event
from llm.types import ToolUseBlock

from ..sources.base import ToolContext
from .call import Attempt, Call, digest


class Paused(Exception):
    """A tool call awaits a person's approval; the attempt resumes when it is decided."""

    def __init__(self, call: ToolUseBlock) -> None:
        super().__init__(f"tool call {call.id} ({call.name}) awaits approval")
        self.call = call


class Approvals:
    """Where the pipeline asks for and reads approval decisions (`RedisApprovals` in a worker)."""

    async def decision(self, call_id: str) -> ApprovalDecision | None:  # None: not decided yet
        raise NotImplementedError

    async def request(self, call: ToolUseBlock, ctx: ToolContext) -> None:
        raise NotImplementedError


class RedisApprovals(Approvals):
    def __init__(self, book: ApprovalBook, goal_id: str) -> None:
        self.book = book
        self.goal_id = goal_id

    async def decision(self, call_id: str) -> ApprovalDecision | None:
        return await self.book.decision(self.goal_id, call_id)

    async def request(self, call: ToolUseBlock, ctx: ToolContext) -> None:
        earlier = await self.book.earlier_calls(ctx.goal_id, ctx.task_id, ctx.attempt, call.name)
        event = Event(
            type="tool.approval_requested",
            goal_id=self.goal_id,
            task_id=ctx.task_id,
            data={"call_id": call.id, "tool": call.name, "args_digest": digest(call.input), "earlier": len(earlier)},
        )
        # One script: the request, the cross-goal inbox entry and the event (only the first time).
        await self.book.request(
            self.goal_id, call.id, ctx.task_id, ctx.attempt, call.name, dict(call.input), event, earlier
        )


class Approval:
    name: ClassVar[str] = "approval"
    every_call: ClassVar[bool] = False

    def __init__(self, attempt: Attempt | None) -> None:
        self.attempt = attempt

    async def __call__(self, call: Call) -> None:
        a, tool = self.attempt, call.tool
        if a is None or a.approvals is None or tool is None or not tool.requires_approval:
            return
        decision = await a.approvals.decision(call.block.id)
        if decision is None:
            await a.approvals.request(call.block, call.ctx)
            raise Paused(call.block)
        if not decision.approved:
            why = decision.reason or "no reason given"
            call.fail("denied", f"{call.block.name} was not run: denied by an operator: {why}", self.name)
