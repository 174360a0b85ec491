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
from typing import Any

from redis.asyncio import Redis

from .keys import Keys
from .schemas import GOAL_ID_PATTERN, GoalState

# KEYS: goal index
# ARGV: max score ('+inf' or the cursor's score), cursor id ('' = none), states (comma-separated,
#       '' = any), limit, scan cap, goal key prefix (Keys.goal(''))
# Returns {ids, last score, last id} (last = '' when the index is exhausted)
_PAGE = """
local want = nil
if ARGV[3] ~= '' then
  want = {}
  for s in string.gmatch(ARGV[3], '[^,]+') do want[s] = true end
end
local limit, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
local cur_score = nil
if ARGV[2] ~= '' then cur_score = tonumber(ARGV[1]) end
local out, seen, offset = {}, 0, 0
while true do
  local rows = redis.call('ZREVRANGEBYSCORE', KEYS[1], ARGV[1], '-inf', 'WITHSCORES', 'LIMIT', offset, 100)
  if #rows == 0 then return {out, '', ''} end
  for i = 1, #rows, 2 do
    local id, score = rows[i], rows[i + 1]
    -- Equal scores come in reverse id order: skip the cursor and everything before it.
    if not (cur_score and tonumber(score) == cur_score and id >= ARGV[2]) then
      seen = seen + 1
      local st = redis.call('HGET', ARGV[6] .. id, 'state')
      if st and (not want or want[st]) then out[#out + 1] = id end
      if #out >= limit or seen >= cap then
        -- The last entry of the index: no cursor, so a reader knows there is nothing more.
        if i + 1 >= #rows and #rows < 200 then return {out, '', ''} end
        return {out, score, id}
      end
    end
  end
  offset = offset + 100
end
"""


class BadCursor(ValueError):
    """The cursor was not one a page returned."""


@dataclass(frozen=True)
class GoalPage:
    ids: list[str]
    next_cursor: str | None


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


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
        self._page = redis.register_script(_PAGE)

    async def page(
        self, states: list[GoalState] | None = None, cursor: str | None = None, limit: int = 50, scan: int = 2000
    ) -> GoalPage:
        """Up to `limit` goal ids, newest first, in one of `states` (None: any), after `cursor`."""
        score, after = decode_cursor(cursor) if cursor else ("+inf", "")
        ids, last_score, last_id = await self._page(
            keys=[self.keys.goal_index()],
            args=[score, after, ",".join(s.value for s in states or []), limit, scan, self.keys.goal("")],
        )
        nxt = encode_cursor(_s(last_score), _s(last_id)) if _s(last_id) else None
        return GoalPage([_s(i) for i in ids], nxt)
