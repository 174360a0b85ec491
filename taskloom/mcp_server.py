"""`taskloom mcp`: the fleet as an MCP server, so that any MCP host (an IDE, a desktop assistant,
another agent) can submit goals, watch them and decide approvals.

Tools, each a thin call of `bus.client.Client`:

- `submit_goal`, `cancel_goal`, `approve_call`, `deny_call` change state; `--read-only` leaves
  them out, so a read-only server can watch the fleet and nothing else.
- `goal_status` (with the calls awaiting approval), `wait_goal` (bounded by `--max-wait`, and it
  answers "not done yet" instead of failing when the time is up; a request with a progress token
  gets progress notifications: state changes and, about once a second, a running task's latest
  words), `goal_events` (a page of the goal's audit stream, with the position to continue from).

`approve_call` and `deny_call` are annotated destructive and carry `_meta` `dev.taskloom/approval`,
so a host asks its user before calling them. Failures (an unknown goal, an invalid goal, a call
already decided) come back as `isError` results whose text says what is wrong.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import mcp_types as mt
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import ValidationError

from bus.approvals import AlreadyDecided
from bus.client import Client, WaitTimeout
from bus.live import LiveFrame, LiveTexts
from bus.schemas import Event, Goal, GoalRecord
from bus.store import IllegalTransition, NotFound
from llm.forced import validation_problems

APPROVAL_META = {"dev.taskloom/approval": True}
READ = mt.ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)
WRITE = mt.ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
DESTRUCTIVE = mt.ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)
MAX_EVENTS = 500
T = TypeVar("T")


# A task's live text is reported at most this often (seconds), its last words only.
TEXT_EVERY = 1.0
TEXT_TAIL = 160


def _progress_token(ctx: Context) -> object | None:
    """The request's `_meta.progressToken` (MCP's place for it), or None: no progress was asked for,
    so `wait_goal` waits without subscribing to the goal's live text (whose calls then need not stream)."""
    try:
        params = ctx.request_context.params or {}
    except ValueError:  # outside a request
        return None
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get("progressToken") if isinstance(meta, dict) else None


def progress_message(item: Event | LiveFrame, texts: LiveTexts) -> str | None:
    """The progress notification for one item of `Client.follow`, or None (not worth one)."""
    if isinstance(item, LiveFrame):
        held = texts.apply(item)
        if item.type == "restart":
            return f"{item.task}: restarted (attempt {item.attempt}, step {item.step} is written again)"
        tail = held.text[-TEXT_TAIL:]
        return f"{item.task} writing: {'…' if len(held.text) > TEXT_TAIL or held.gap else ''}{tail}"
    if item.type == "goal.state":
        return f"goal: {item.data.get('state')}"
    if item.type == "task.state":
        return f"{item.task_id}: {item.data.get('state')}"
    return None


async def _wait_reporting(client: Client, goal_id: str, bound: float, ctx: Context) -> GoalRecord:
    """`Client.wait`, reporting the goal's progress (`progress_message`) as it comes; raises
    `WaitTimeout` as `wait` does. From the goal's newest event on: the past is in goal_events."""
    past = await client.log.read(goal_id)
    after = past[-1].position if past else None
    texts = LiveTexts()
    count = 0
    last_text: dict[str, float] = {}
    try:
        async with asyncio.timeout(bound):
            async for item in client.follow(goal_id, after):
                message = progress_message(item, texts)
                if message is None:
                    continue
                if isinstance(item, LiveFrame) and item.type == "text":
                    now = time.monotonic()
                    if now - last_text.get(item.task, 0.0) < TEXT_EVERY:
                        continue  # the words go on; the next report carries them
                    last_text[item.task] = now
                count += 1
                await ctx.report_progress(count, None, message)
    except TimeoutError:
        goal = await client.get(goal_id)
        if not goal.terminal:
            raise WaitTimeout(goal_id, goal.state.value, bound) from None
    return await client.get(goal_id)


def _problems(exc: ValidationError) -> str:
    return "; ".join(validation_problems(exc))


def build(client: Client, *, read_only: bool = False, max_wait: float = 60.0) -> MCPServer:
    """The MCP server over `client` (which the caller opens and closes)."""
    server: MCPServer = MCPServer(
        "taskloom",
        instructions=(
            "Submit goals to a taskloom fleet (planner, executors, critic) and follow them. A goal runs "
            "asynchronously: submit_goal returns its id; use wait_goal or goal_status until it ends. "
            "Tool calls that need a person's approval are listed by goal_status under 'approvals'."
        ),
        log_level="WARNING",
    )
    _add_read_tools(server, client, max_wait)
    if not read_only:
        _add_write_tools(server, client)
    return server


async def _guarded(call: Awaitable[T]) -> T:
    """The call's result; what the caller got wrong comes back as a `ToolError` saying so."""
    try:
        return await call
    except AlreadyDecided:
        raise  # not an error: `decide` reports the decision that stands
    except (NotFound, IllegalTransition) as exc:
        raise ToolError(str(exc)) from None
    except ValidationError as exc:
        raise ToolError(f"invalid input: {_problems(exc)}") from None
    except ValueError as exc:
        raise ToolError(str(exc)) from None


def _add_read_tools(server: MCPServer, client: Client, max_wait: float) -> None:
    @server.tool(annotations=READ)
    async def goal_status(goal_id: str) -> dict[str, Any]:
        """A goal's state, answer or reason, plan version, every task's state, and the tool calls
        awaiting a person's approval (by call id)."""
        status = await _guarded(client.status(goal_id))
        approvals = await _guarded(client.approvals(goal_id))
        goal = status.goal
        return {
            "goal_id": goal.id,
            "state": goal.state.value,
            "answer": goal.answer,
            "reason": goal.reason,
            "plan_version": goal.plan_version,
            "tasks": [{"task_id": t.task_id, "state": t.state.value, "attempt": t.attempt} for t in status.tasks],
            "approvals": {cid: req.model_dump(mode="json") for cid, req in approvals.items()},
        }

    @server.tool(annotations=READ)
    async def wait_goal(goal_id: str, ctx: Context, timeout_seconds: float = 30.0) -> dict[str, Any]:
        """Wait until a goal ends, at most `timeout_seconds` (capped by the server). Returns
        done=false and the current state when the time is up: call it again to keep waiting.
        A request with a progress token gets progress notifications meanwhile: each state change
        of the goal and its tasks, and the words a task's model is writing (live text)."""
        bound = max(0.0, min(timeout_seconds, max_wait))
        try:
            if _progress_token(ctx) is None:
                goal = await _guarded(client.wait(goal_id, timeout=bound))
            else:
                goal = await _guarded(_wait_reporting(client, goal_id, bound, ctx))
        except WaitTimeout as exc:
            return {"goal_id": goal_id, "done": False, "state": exc.state, "waited_seconds": bound}
        done = {"goal_id": goal.id, "done": True, "state": goal.state.value}
        return {**done, "answer": goal.answer, "reason": goal.reason}

    @server.tool(annotations=READ)
    async def goal_events(goal_id: str, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of the goal's events (plan, task states, tool calls, approvals), oldest first, after
        position `after` (omit it to start at the beginning). Pass `next_after` back to continue."""
        if not 1 <= limit <= MAX_EVENTS:
            raise ToolError(f"limit must be between 1 and {MAX_EVENTS}, got {limit}")
        events = []
        async for event in client.events(goal_id, after=after, follow=False):
            events.append(event.model_dump(mode="json"))
            if len(events) >= limit:
                break
        return {"events": events, "next_after": events[-1]["position"] if events else after}


def _goal_of(
    text: str,
    definition_of_done: str,
    budget_tokens: int | None,
    allowed_tools: list[str] | None,
    deadline: str | None,
) -> Goal:
    """The goal `submit_goal` was given, or a `ToolError` naming what is wrong with it."""
    raw: dict[str, Any] = {"text": text, "definition_of_done": definition_of_done}
    if budget_tokens is not None:
        raw["budget_tokens"] = budget_tokens
    if allowed_tools is not None:
        raw["allowed_tools"] = allowed_tools
    if deadline is not None:
        try:
            raw["deadline"] = dt.datetime.fromisoformat(deadline.replace("Z", "+00:00"))
        except ValueError:
            raise ToolError(f"deadline: expected an ISO 8601 time, got {deadline!r}") from None
    try:
        return Goal.model_validate(raw)
    except ValidationError as exc:
        raise ToolError(f"invalid goal: {_problems(exc)}") from None


async def _decide(client: Client, goal_id: str, call_id: str, approved: bool, reason: str) -> dict[str, Any]:
    """Decide once; a repeat changes nothing and reports the decision that stands."""
    try:
        first = await _guarded(client.decide(goal_id, call_id, approved, reason, by="mcp"))
        decided = await client.decision(goal_id, call_id)
    except AlreadyDecided as exc:
        first, decided = False, exc.decision
    verdict = decided.verdict if decided else None
    return {"goal_id": goal_id, "call_id": call_id, "approved": approved, "first_decision": first, "decision": verdict}


def _add_write_tools(server: MCPServer, client: Client) -> None:
    @server.tool(annotations=WRITE)
    async def submit_goal(
        text: str,
        definition_of_done: str = "",
        budget_tokens: int | None = None,
        allowed_tools: list[str] | None = None,
        deadline: str | None = None,
        goal_id: str | None = None,
    ) -> dict[str, Any]:
        """Submit a goal to the fleet; returns its id at once (the goal runs asynchronously).
        `deadline` is an ISO 8601 time with a zone; `goal_id` (your own id) makes re-submitting safe."""
        goal = _goal_of(text, definition_of_done, budget_tokens, allowed_tools, deadline)
        return {"goal_id": await _guarded(client.submit(goal, goal_id=goal_id))}

    @server.tool(annotations=DESTRUCTIVE)
    async def cancel_goal(goal_id: str, reason: str = "cancelled by an MCP client") -> dict[str, Any]:
        """Cancel a goal and its unfinished tasks."""
        changed = await _guarded(client.cancel(goal_id, reason))
        return {"goal_id": goal_id, "cancelled": True, "already_cancelled": not changed}

    @server.tool(annotations=DESTRUCTIVE.model_copy(update={"title": "Approve a tool call"}), meta=APPROVAL_META)
    async def approve_call(goal_id: str, call_id: str) -> dict[str, Any]:
        """APPROVAL: let a tool call that awaits a person's approval run (see goal_status 'approvals')."""
        return await _decide(client, goal_id, call_id, True, "")

    @server.tool(annotations=DESTRUCTIVE.model_copy(update={"title": "Deny a tool call"}), meta=APPROVAL_META)
    async def deny_call(goal_id: str, call_id: str, reason: str = "denied by an operator") -> dict[str, Any]:
        """APPROVAL: refuse a tool call that awaits approval; the agent sees an ERROR with `reason`."""
        return await _decide(client, goal_id, call_id, False, reason)
