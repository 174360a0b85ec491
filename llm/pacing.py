"""Read a streamed reply in gulps: one socket read for the events of a whole interval, not one each.

A provider writes a long answer as hundreds of small server-sent events, each its own packet. Read
as they come, every event costs the worker a socket read and a trip through the HTTP stack and the
event loop: that, not parsing or publishing, is most of what streaming costs (bench.streaming). A
reader that, having waited for an event, waits `interval` more before asking for the next lets the
events of that interval gather in the socket's buffer, and then reads them in one go. The text still
arrives within one interval of being written, which is the live batches' own interval, so a watcher
sees no difference; the reply as a whole ends at most one interval later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")

# The live batches' own interval (bus.live): reading more often would only feed the same batches.
READ_INTERVAL_S = 0.1
# An event handed over faster than this came from what was already read: no socket read was waited on.
BUFFERED_S = 0.001


async def gulped(events: AsyncIterator[T], interval: float = READ_INTERVAL_S) -> AsyncIterator[T]:
    """`events`, pausing `interval` after each one the reader had to wait for (interval 0: as they come)."""
    while True:
        asked = time.monotonic()
        try:
            item = await anext(events)
        except StopAsyncIteration:
            return
        waited = time.monotonic() - asked > BUFFERED_S
        yield item
        if waited and interval > 0:
            await asyncio.sleep(interval)
