"""Listing goals, newest first, filtered by state, one page at a time with a cursor.

Goals are indexed by submission time in one sorted set (`Keys.goal_index`, written by the store's
create script). A page is read by one Lua script that walks the index downwards from the cursor
and reads each goal's state, so a page is a consistent snapshot and costs one round trip. A cursor
is the last entry a page looked at (its score and id), so goals submitted meanwhile never shift a
later page, unlike an offset. A filtered page looks at no more than `scan` entries: when it stops
there with fewer matches than asked, it still returns a cursor, and the next page carries on. A
page that ends at the index's last entry has no cursor, whether it is full or not.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from redis.asyncio import Redis

from .keys import Keys
from .replies import as_str
from .schemas import GOAL_ID_PATTERN, GoalState
from .scripts import lua, registered

_PAGE = lua("goal_index_page")


class BadCursor(ValueError):
    """The cursor was not one a page returned."""


@dataclass(frozen=True)
class GoalPage:
    ids: list[str]
    next_cursor: str | None


def encode_cursor(score: str, goal_id: str) -> str:
    return base64.urlsafe_b64encode(f"{score}|{goal_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[str, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        score, goal_id = raw.split("|", 1)
        float(score)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise BadCursor("cursor: not a cursor returned by a previous page") from None
    if not re.match(GOAL_ID_PATTERN, goal_id):
        raise BadCursor("cursor: not a cursor returned by a previous page")
    return score, goal_id


class GoalIndex:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._page = registered(redis, _PAGE)

    async def page(
        self, states: list[GoalState] | None = None, cursor: str | None = None, limit: int = 50, scan: int = 2000
    ) -> GoalPage:
        """Up to `limit` goal ids, newest first, in one of `states` (None: any), after `cursor`."""
        score, after = decode_cursor(cursor) if cursor else ("+inf", "")
        ids, last_score, last_id = await self._page(
            keys=[self.keys.goal_index()],
            args=[score, after, ",".join(s.value for s in states or []), limit, scan, self.keys.goal("")],
        )
        nxt = encode_cursor(as_str(last_score), as_str(last_id)) if as_str(last_id) else None
        return GoalPage([as_str(i) for i in ids], nxt)
