"""Event streams: one capped Redis Stream per goal, plus one global stream for every goal.

An event's `position` is its stream id; reading "after" a position resumes exactly where a watcher
stopped, across restarts. State changes emit their event inside the same Lua script that makes the
change (see `bus.store`), so the stream never disagrees with the state it reports.
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from .keys import Keys
from .replies import as_str
from .schemas import Event
from .scripts import lua, registered

FIELD = "e"  # each stream entry holds one field: the event as JSON


class CorruptRecord(Exception):
    """A record in Redis cannot be read back (not JSON, or not the schema): the message names it and its key.

    Raised instead of a parsing error so that callers can tell damaged data in Redis from bad input.
    """

    def __init__(self, what: str, key: str, detail: str) -> None:
        super().__init__(f"corrupt {what} in Redis at key {key!r}: {detail[:300]}")
        self.what = what
        self.key = key
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.key, self.detail))


def first_error(exc: Exception) -> str:
    """One line saying what is wrong with a record: the first pydantic error, or the exception."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            e = errors()[0]
            where = ".".join(str(p) for p in e["loc"])
            return f"{where}: {e['msg']}" if where else str(e["msg"])
        except Exception:
            pass
    return f"{type(exc).__name__}: {exc}"


def _as_bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def encode(event: Event) -> str:
    # No `trace_id` key when tracing is off: an event pays no bytes for a feature not in use.
    return event.model_dump_json(exclude={"position"} if event.trace_id else {"position", "trace_id"})


def decode(position: bytes | str, fields: dict[Any, Any]) -> Event:
    raw = fields.get(FIELD.encode()) if FIELD.encode() in fields else fields.get(FIELD)
    if raw is None:
        raise ValueError(f"stream entry {position!r} has no {FIELD!r} field")
    pos = position.decode() if isinstance(position, bytes) else position
    return Event.model_validate({**json.loads(raw), "position": pos})


# The scripts (bus/lua/): each file's header says its KEYS, ARGV and reply.
_EMIT = lua("events_emit")


class EventLog:
    def __init__(self, redis: Redis, keys: Keys, maxlen: int = 10_000) -> None:
        self.redis = redis
        self.keys = keys
        self.maxlen = maxlen
        self._emit = registered(redis, _EMIT)

    async def emit(self, event: Event) -> str:
        """Append to the goal's stream and the global stream (atomically); return the goal position."""
        pos = await self._emit(
            keys=[self.keys.goal_events(event.goal_id), self.keys.global_events()], args=[encode(event), self.maxlen]
        )
        return as_str(pos)

    async def last_position(self, goal_id: str | None) -> str | None:
        """The position of the newest event of the goal (None: of every goal); None when there is none."""
        key = self.keys.global_events() if goal_id is None else self.keys.goal_events(goal_id)
        tail = await self.redis.xrevrange(key, count=1)
        return as_str(tail[0][0]) if tail else None

    async def next_position(
        self, goal_id: str, after: str | None, block_ms: int, marker: str
    ) -> tuple[str | None, bool]:
        """Wait up to `block_ms` for events of the goal after `after`, without decoding them: the
        newest position (None: nothing came) and whether one of them is of type `marker`.

        For a waiter that only needs to know *when* to look again (`Client.wait`): matching the
        type in the stored JSON costs nothing, validating every event costs a model parse each."""
        key = self.keys.goal_events(goal_id)
        try:
            reply = await self.redis.xread({key: after or "0-0"}, count=1000, block=block_ms)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            raise CorruptRecord("event stream", key, str(exc)) from None
        rows = reply[0][1] if reply else []
        if not rows:
            return None, False
        # Events are stored compact by `encode`, their "type" first.
        head = f'{{"type":"{marker}"'.encode()
        seen = any(_as_bytes(fields.get(FIELD.encode(), fields.get(FIELD, b""))).startswith(head) for _, fields in rows)
        pos = rows[-1][0]
        return as_str(pos), seen

    async def read(
        self, goal_id: str | None, after: str | None = None, count: int = 1000, block_ms: int | None = None
    ) -> list[Event]:
        """Events after `after` (exclusive; None = from the start). `goal_id=None` reads the global stream.

        With `block_ms`, waits up to that long for at least one new event.
        """
        key = self.keys.global_events() if goal_id is None else self.keys.goal_events(goal_id)
        start = after or "0-0"
        try:
            if block_ms is None:
                rows = await self.redis.xrange(key, min=f"({start}" if after else "-", count=count)
            else:
                reply = await self.redis.xread({key: start}, count=count, block=block_ms)
                rows = reply[0][1] if reply else []
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise  # e.g. an invalid stream id: the caller's input, not the data
            raise CorruptRecord("event stream", key, str(exc)) from None
        try:
            return [decode(pos, fields) for pos, fields in rows]
        except (ValueError, TypeError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
            raise CorruptRecord("event", key, first_error(exc)) from None

