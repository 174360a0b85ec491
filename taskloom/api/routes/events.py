"""Event streams: server-sent events whose ids are stream positions, so that a client reconnecting
with `Last-Event-ID` resumes exactly where it stopped, on any API process."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse

from bus.client import Client
from bus.schemas import Event

from .. import models as m
from ..deps import ClientDep, Draining, GoalIdPath, Reader, goal_id_of, position

router = APIRouter(tags=["events"])

KEEPALIVE_S = 15.0
# A stream cut by a shutdown asks its client to come back this soon (on another API process, or this one restarted).
SHUTDOWN_RETRY_MS = 1000

SSE_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": "server-sent events: `id` is the stream position, `data` an Event as JSON; "
        "an `end` event when the goal has ended; a `shutdown` event (with `retry`) when the server "
        "stops: reconnect with Last-Event-ID",
    }
}


@router.get(
    "/v1/goals/{goal_id}/events",
    response_class=StreamingResponse,
    responses={**SSE_DOC, 404: {"model": m.ErrorBody}},
)
async def goal_events(
    goal_id: GoalIdPath,
    _: Reader,
    c: ClientDep,
    draining: Draining,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", description="resume after this position")
    ] = None,
    after: Annotated[str | None, Query(description="resume after this position (as Last-Event-ID)")] = None,
    access_token: Annotated[str | None, Query(description="the token, for EventSource (no headers)")] = None,
) -> StreamingResponse:
    """The goal's events from the start (or after a position), live, until the goal ends."""
    await c.get(goal_id_of(goal_id))
    start = position(last_event_id, "Last-Event-ID") or position(after, "after")
    return sse(follow(c, goal_id, start), draining)


@router.get("/v1/events", response_class=StreamingResponse, responses=SSE_DOC)
async def all_events(
    _: Reader,
    c: ClientDep,
    draining: Draining,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
    after: Annotated[str | None, Query(description="position, or `$` for new events only")] = None,
    access_token: Annotated[str | None, Query(description="the token, for EventSource (no headers)")] = None,
) -> StreamingResponse:
    """Every goal's events, live (the console's goals table follows this); never ends."""
    start = position(last_event_id, "Last-Event-ID") or (after if after == "$" else position(after, "after"))
    if start == "$":
        start = await c.log.last_position(None) or "0-0"
    return sse(follow(c, None, start), draining)


END, KEEPALIVE, SHUTDOWN = "end", "keepalive", "shutdown"


async def follow(c: Client, goal_id: str | None, after: str | None) -> AsyncGenerator[Event | str, None]:
    """Events after `after`, then `END` once the goal has ended (a goal's stream), with a
    `KEEPALIVE` now and then while nothing happens (so proxies and clients see a live stream)."""
    idle_since = time.monotonic()
    while True:
        batch = await c.log.read(goal_id, after=after or "0-0", count=200, block_ms=1000)
        for e in batch:
            after = e.position
            yield e
        if batch:
            idle_since = time.monotonic()
            continue
        if goal_id is not None and (await c.get(goal_id)).terminal:
            for e in await c.log.read(goal_id, after=after):  # written between the read and the check
                after = e.position
                yield e
            yield END
            return
        if time.monotonic() - idle_since > KEEPALIVE_S:
            idle_since = time.monotonic()
            yield KEEPALIVE


async def _until(draining: asyncio.Event, events: AsyncGenerator[Event | str, None]) -> AsyncIterator[Event | str]:
    """The items of `events` until `draining` is set, then `SHUTDOWN` at once: a read waiting on
    Redis is cancelled, so that a stopping server is not held up by its open streams."""
    stop = asyncio.create_task(draining.wait())
    pending: asyncio.Task[Event | str | None] | None = None

    async def next_item() -> Event | str | None:
        return await anext(events, None)

    try:
        while True:
            pending = asyncio.create_task(next_item())
            await asyncio.wait({pending, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                yield SHUTDOWN
                return
            item = pending.result()
            if item is None:
                return
            yield item
    finally:
        for task in (stop, pending):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(RuntimeError):  # an async generator cancelled mid-read is already closed
            await events.aclose()


def sse(events: AsyncGenerator[Event | str, None], draining: asyncio.Event) -> StreamingResponse:
    async def frames() -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        async for e in _until(draining, events):
            if e == END:
                yield "event: end\ndata: {}\n\n"
                return
            if e == SHUTDOWN:
                yield f'retry: {SHUTDOWN_RETRY_MS}\nevent: shutdown\ndata: {{"reconnect": true}}\n\n'
                return
            if e == KEEPALIVE:
                yield ": keepalive\n\n"
                continue
            assert isinstance(e, Event)
            yield f"id: {e.position}\ndata: {e.model_dump_json()}\n\n"

    return StreamingResponse(
        frames(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
