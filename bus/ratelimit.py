"""Fleet-wide provider rate limits: one set of token buckets per model in Redis, shared by every worker.

A provider limits requests per minute, input tokens per minute and output tokens per minute per
model (Anthropic's tiers), with token buckets: a bucket holds up to one minute's allowance and
refills continuously. Per-process limiters would each believe they own the whole allowance and 429
one another; here every worker's call takes from the same buckets, in one Lua script.

Protocol, per model call (`bus.metered.MeteredModel`), before the ledger's reservation:
* `acquire(limit, tenant, input estimate, max_tokens)` takes 1 request, the input estimate and
  `max_tokens` (the provider also counts output against `max_tokens` at the start of a call). A
  call that does not fit *waits its turn*: it is never failed for it. Waiting calls queue in fair
  order across tenants: each tenant's next call is numbered after that tenant's previous one and
  after the last call served, so tenants are served round-robin however many calls each one queues
  (start-time fair queueing, one request = one unit). Only the head of the queue takes tokens; the
  others poll. A waiter that stopped polling (its worker died) is dropped from the queue.
* `settle(limit, reserved, used)` gives back what the call did not use (output below `max_tokens`,
  input below the estimate), as the provider does.
* `throttled(limit, retry_after)`: the provider still answered 429 (another client shares the
  key, or the configured limits are too high). Nobody starts a call before `retry-after` has
  passed, the buckets are emptied, and for `PENALTY_SECONDS` they hold and refill at
  `PENALTY_FACTOR` of the configured limits.
* `observe_remaining(limit, remaining)`: the provider's `anthropic-ratelimit-*-remaining` headers
  say how much is left; a bucket holding more than that is lowered to it.

Who retries what (docs/internals.md) is unchanged: this limiter never retries a call. It delays a
call before it is sent (no request, no reservation held meanwhile); a 429 that still happens is
retried by the SDK within the call and then by the job layer, as any provider error. The limiter
only makes later calls of every worker slow down, so the retries are not met by a new wall of
requests.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from redis.asyncio import Redis

from .keys import Keys

PENALTY_SECONDS = 60.0
PENALTY_FACTOR = 0.5
# A waiter not seen for this long is dropped from the queue (polls come every POLL_MAX at most).
STALE_AFTER = 10.0
POLL_MIN = 0.02
POLL_MAX = 1.0


class RateLimit(BaseModel):
    """One model's limits per minute; 0 = no limit of that kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rpm: int = Field(default=0, ge=0, description="requests per minute")
    input_tpm: int = Field(default=0, ge=0, description="input tokens per minute")
    output_tpm: int = Field(default=0, ge=0, description="output tokens per minute")


RATE_LIMITS_ADAPTER = TypeAdapter(dict[str, RateLimit])


def load_rate_limits(raw: str | None = None, path: Path | None = None) -> dict[str, RateLimit]:
    """Limits from JSON text (`TASKLOOM_RATE_LIMITS`) and/or a JSON file (`TASKLOOM_RATE_LIMITS_FILE`),
    `{"model-prefix": {"rpm": 50, "input_tpm": 30000, "output_tpm": 8000}}`; the text wins per model.
    Raises ValueError naming what is wrong."""
    out: dict[str, RateLimit] = {}
    if path is not None:
        try:
            out.update(RATE_LIMITS_ADAPTER.validate_json(path.read_text()))
        except OSError as exc:
            raise ValueError(f"rate limits file {path}: {exc}") from exc
    if raw:
        out.update(RATE_LIMITS_ADAPTER.validate_json(raw))
    for name in out:
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"rate limits: model name {name!r} must be non-empty without spaces")
    return out


class RateLimitTable:
    """Model id -> the limits of its longest matching prefix (as prices match)."""

    def __init__(self, limits: Mapping[str, RateLimit]) -> None:
        self._limits = sorted(limits.items(), key=lambda kv: len(kv[0]), reverse=True)

    def __bool__(self) -> bool:
        return bool(self._limits)

    def find(self, model: str | None) -> tuple[str, RateLimit] | None:
        if model is None:
            return None
        return next(((n, lim) for n, lim in self._limits if model == n or model.startswith(n)), None)


@dataclass(frozen=True)
class Grant:
    """What one call took from the buckets (given back in part by `settle`)."""

    bucket: str
    input_tokens: int
    output_tokens: int
    waited: float  # seconds spent waiting for the turn


# Shared: refill the three buckets to now. Levels are floats in the hash; `cap` is the minute's
# allowance scaled by the penalty factor while a penalty lasts.
_LIB = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function refill(key, t, caps)
  local h = redis.call('HMGET', key, 'req', 'in', 'out', 'ts', 'penalty_until', 'factor')
  local factor = 1
  if tonumber(h[5] or 0) > t then factor = tonumber(h[6] or 1) end
  local last = tonumber(h[4] or t)
  local levels = {}
  for i = 1, 3 do
    local cap = caps[i] * factor
    local level = tonumber(h[i] or cap)
    levels[i] = math.min(cap, level + math.max(0, t - last) * cap / 60)
  end
  return levels, factor
end

local function store(key, t, levels)
  redis.call('HSET', key, 'req', levels[1], 'in', levels[2], 'out', levels[3], 'ts', string.format('%.6f', t))
end
"""

# KEYS: bucket hash, queue zset, goal books (its `tenant` field names the tenant when ARGV[2] is '').
# ARGV: waiter id, tenant, input, output, rpm, itpm, otpm, stale after.
# Returns {'ok', waited_since} | {'wait', seconds}
_ACQUIRE = (
    _LIB
    + """
local t = now()
local caps = {tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])}
local alive = KEYS[2] .. ':alive'
local id, tenant = ARGV[1], ARGV[2]
if tenant == '' then tenant = redis.call('HGET', KEYS[3], 'tenant') or 'default' end
if not redis.call('ZSCORE', KEYS[2], id) then
  local vt = tonumber(redis.call('HGET', KEYS[1], 'vt') or 0)
  local last = tonumber(redis.call('HGET', KEYS[1], 'last:' .. tenant) or 0)
  local score = math.max(vt, last) + 1
  redis.call('ZADD', KEYS[2], score, id)
  redis.call('HSET', KEYS[1], 'last:' .. tenant, score, 'since:' .. id, string.format('%.6f', t))
end
redis.call('ZADD', alive, string.format('%.6f', t), id)
-- Drop waiters that stopped polling (their worker died), so they cannot block the queue.
local stale = redis.call('ZRANGEBYSCORE', alive, '-inf', string.format('%.6f', t - tonumber(ARGV[8])))
for _, s in ipairs(stale) do
  redis.call('ZREM', KEYS[2], s)
  redis.call('ZREM', alive, s)
  redis.call('HDEL', KEYS[1], 'since:' .. s)
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
if head ~= id then return {'wait', 'queue'} end
local blocked = tonumber(redis.call('HGET', KEYS[1], 'blocked_until') or 0)
if blocked > t then return {'wait', string.format('%.6f', blocked - t)} end
local levels, factor = refill(KEYS[1], t, caps)
local need = {1, tonumber(ARGV[3]), tonumber(ARGV[4])}
local wait = 0
for i = 1, 3 do
  if caps[i] > 0 then
    local cap = caps[i] * factor
    -- A call larger than a whole bucket waits for a full bucket (it could never pass otherwise).
    local n = math.min(need[i], cap)
    if levels[i] < n then wait = math.max(wait, (n - levels[i]) * 60 / cap) end
  end
end
store(KEYS[1], t, levels)
if wait > 0 then return {'wait', string.format('%.6f', wait)} end
for i = 1, 3 do
  if caps[i] > 0 then levels[i] = levels[i] - need[i] end
end
store(KEYS[1], t, levels)
local score = redis.call('ZSCORE', KEYS[2], id)
redis.call('ZREM', KEYS[2], id)
redis.call('ZREM', alive, id)
redis.call('HSET', KEYS[1], 'vt', score)
local since = redis.call('HGET', KEYS[1], 'since:' .. id) or string.format('%.6f', t)
redis.call('HDEL', KEYS[1], 'since:' .. id)
return {'ok', string.format('%.6f', t - tonumber(since))}
"""
)

# KEYS: bucket hash. ARGV: rpm, itpm, otpm, input back, output back. Gives back unused tokens.
_SETTLE = (
    _LIB
    + """
local t = now()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local levels, factor = refill(KEYS[1], t, caps)
levels[2] = math.min(caps[2] * factor, levels[2] + tonumber(ARGV[4]))
levels[3] = math.min(caps[3] * factor, levels[3] + tonumber(ARGV[5]))
store(KEYS[1], t, levels)
return 1
"""
)

# KEYS: bucket hash. ARGV: rpm, itpm, otpm, retry after (s), penalty seconds, penalty factor.
_THROTTLED = (
    _LIB
    + """
local t = now()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local blocked = math.max(tonumber(redis.call('HGET', KEYS[1], 'blocked_until') or 0), t + tonumber(ARGV[4]))
redis.call('HSET', KEYS[1], 'blocked_until', string.format('%.6f', blocked),
           'penalty_until', string.format('%.6f', t + tonumber(ARGV[5])), 'factor', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'throttled', 1)
store(KEYS[1], t, {0, 0, 0})
return 1
"""
)

# KEYS: bucket hash. ARGV: rpm, itpm, otpm, then remaining requests, input, output (-1 = unknown).
_REMAINING = (
    _LIB
    + """
local t = now()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local levels = refill(KEYS[1], t, caps)
for i = 1, 3 do
  local r = tonumber(ARGV[3 + i])
  if r >= 0 and caps[i] > 0 and r < levels[i] then levels[i] = r end
end
store(KEYS[1], t, levels)
return 1
"""
)


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RateLimiter:
    """The fleet's buckets, one per configured model prefix, under one key prefix."""

    def __init__(self, redis: Redis, keys: Keys, limits: Mapping[str, RateLimit]) -> None:
        self.redis = redis
        self.keys = keys
        self.table = RateLimitTable(limits)
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)
        self._throttled = redis.register_script(_THROTTLED)
        self._remaining = redis.register_script(_REMAINING)

    def _caps(self, lim: RateLimit) -> list[int]:
        return [lim.rpm, lim.input_tpm, lim.output_tpm]

    async def acquire(
        self, model: str | None, goal_id: str, input_tokens: int, output_tokens: int, tenant: str | None = None
    ) -> Grant | None:
        """Wait for this call's turn and take its tokens; None when the model has no limits. The
        tenant (for fairness) is `tenant`, else the one the goal's books name."""
        found = self.table.find(model)
        if found is None:
            return None
        name, lim = found
        waiter = uuid.uuid4().hex
        keys = [self.keys.ratelimit(name), self.keys.ratelimit_queue(name), self.keys.ledger(goal_id)]
        args: list[str | int | float] = [waiter, tenant or "", input_tokens, output_tokens, *self._caps(lim)]
        args.append(STALE_AFTER)
        started = time.monotonic()
        try:
            while True:
                out = await self._acquire(keys=keys, args=args)
                if _s(out[0]) == "ok":
                    return Grant(name, input_tokens, output_tokens, time.monotonic() - started)
                hint = _s(out[1])
                delay = POLL_MIN * 5 if hint == "queue" else float(hint)
                # Jittered, so the waiters of many workers do not poll in lockstep.
                await asyncio.sleep(min(POLL_MAX, max(POLL_MIN, delay)) * random.uniform(0.8, 1.2))
        except BaseException:
            # Cancelled while waiting: leave the queue at once rather than after STALE_AFTER.
            await asyncio.shield(self._leave(keys, waiter))
            raise

    async def _leave(self, keys: list[str], waiter: str) -> None:
        try:
            await self.redis.zrem(keys[1], waiter)
            await self.redis.zrem(keys[1] + ":alive", waiter)
            await self.redis.hdel(keys[0], "since:" + waiter)  # type: ignore[misc]
        except Exception:  # the waiter is dropped as stale anyway
            return

    def _lim(self, bucket: str) -> RateLimit:
        found = self.table.find(bucket)
        assert found is not None and found[0] == bucket
        return found[1]

    async def settle(self, grant: Grant, used_input: int, used_output: int) -> None:
        """Give back what the call did not use (never more than it took)."""
        back_in = max(0, grant.input_tokens - used_input)
        back_out = max(0, grant.output_tokens - used_output)
        if back_in or back_out:
            lim = self._lim(grant.bucket)
            await self._settle(keys=[self.keys.ratelimit(grant.bucket)], args=[*self._caps(lim), back_in, back_out])

    async def throttled(self, model: str | None, retry_after: float | None) -> None:
        """The provider answered 429: hold every worker's calls for `retry_after` (at least 1 s) and
        shrink the buckets for a while."""
        found = self.table.find(model)
        if found is None:
            return
        name, lim = found
        args = [*self._caps(lim), max(1.0, retry_after or 0.0), PENALTY_SECONDS, PENALTY_FACTOR]
        await self._throttled(keys=[self.keys.ratelimit(name)], args=args)

    async def observe_remaining(
        self, model: str | None, requests: int | None, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        """Lower the buckets to what the provider says is left (its `*-remaining` headers)."""
        found = self.table.find(model)
        if found is None or (requests is None and input_tokens is None and output_tokens is None):
            return
        name, lim = found
        rem = [-1 if v is None else v for v in (requests, input_tokens, output_tokens)]
        await self._remaining(keys=[self.keys.ratelimit(name)], args=[*self._caps(lim), *rem])

    async def state(self, model: str) -> dict[str, str]:
        """The bucket's raw fields (for `taskloom` diagnostics and tests)."""
        found = self.table.find(model)
        if found is None:
            return {}
        raw = await self.redis.hgetall(self.keys.ratelimit(found[0]))  # type: ignore[misc]
        return {_s(k): _s(v) for k, v in raw.items()}

