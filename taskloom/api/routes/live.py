"""`GET /v1/goals/{id}/stream`: a goal's durable events and its models' words as they are written.

One server-sent event stream: every durable event of the goal exactly as `/v1/goals/{id}/events`
sends it (`id:` its stream position, `data:` the Event), interleaved with frames that are never
stored (`bus.live`): `event: text` (goal, task, attempt, step, offset in the call's text, text) and
`event: restart` (drop what you hold of that task's text: the step is being written again). Live
frames carry no id: a reconnect with `Last-Event-ID` resumes the durable events exactly, and the
text from the moment it reconnected. Ends with `event: end` when the goal has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse

from bus.client import Client
from bus.events import CorruptRecord
from bus.live import LiveFrame
from bus.schemas import Event
from bus.store import NotFound

from .. import models as m
from ..deps import ClientDep, Draining, GoalIdPath, Reader, goal_id_of, position
from .events import KEEPALIVE_S, SHUTDOWN_RETRY_MS

router = APIRouter(tags=["events"])

DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": "server-sent events: the goal's events as `/events` sends them (`id` the stream "
        "position, `data` an Event), and, never stored and without an id, `event: text` frames "
        '(`{"type": "text", "goal", "task", "attempt", "step", "offset", "text"}`: the next piece of a '
        "model call's text, `offset` its place in that call's text) and `event: restart` frames "
        '(`{"type": "restart", "goal", "task", "attempt", "step"}`: drop the task\'s text so far, it is '
        "written again); `event: end` when the goal has ended; `event: shutdown` when the server stops",
    },
    404: {"model": m.ErrorBody, "description": "no such goal"},
}


@router.get("/v1/goals/{goal_id}/stream", response_class=StreamingResponse, responses=DOC)
async def goal_stream(
    goal_id: GoalIdPath,
    _: Reader,
    c: ClientDep,
    draining: Draining,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", description="resume the events after this position")
    ] = None,
    after: Annotated[str | None, Query(description="resume the events after this position")] = None,
    access_token: Annotated[str | None, Query(description="the token, for EventSource (no headers)")] = None,
) -> StreamingResponse:
    """The goal's events and, live, its models' words as they are written, until the goal ends."""
    await c.get(goal_id_of(goal_id))
    start = position(last_event_id, "Last-Event-ID") or position(after, "after")
    return StreamingResponse(
        _frames(c, goal_id, start, draining),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _frames(c: Client, goal_id: str, after: str | None, draining: asyncio.Event) -> AsyncIterator[str]:
    """The SSE text of `Client.follow`: durable events with their ids, live frames as named events
    without one; a keepalive comment after 15 s of silence; `shutdown` when the server stops."""
    items = c.follow(goal_id, after)
    stop = asyncio.create_task(draining.wait())
    pending: asyncio.Task[Event | LiveFrame | None] | None = None
    try:
        yield "retry: 2000\n\n"
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items, None))
            done, _ = await asyncio.wait({pending, stop}, timeout=KEEPALIVE_S, return_when=asyncio.FIRST_COMPLETED)
            if pending in done:
                try:
                    item = pending.result()
                except (NotFound, CorruptRecord):
                    item = None  # the goal's records went away (retention) or broke: the stream ends
                pending = None
                if item is None:
                    yield "event: end\ndata: {}\n\n"
                    return
                if isinstance(item, LiveFrame):
                    yield f"event: {item.type}\ndata: {item.model_dump_json()}\n\n"
                else:
                    yield f"id: {item.position}\ndata: {item.model_dump_json()}\n\n"
            elif stop in done:
                yield f'retry: {SHUTDOWN_RETRY_MS}\nevent: shutdown\ndata: {{"reconnect": true}}\n\n'
                return
            else:
                yield ": keepalive\n\n"
    finally:
        for task in (pending, stop):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        with contextlib.suppress(RuntimeError):  # a generator cancelled mid-read is already closed
            await items.aclose()
