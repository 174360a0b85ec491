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
from .replies import as_str
from .scripts import lua, registered

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


# The scripts (bus/lua/): each file's header says its KEYS, ARGV and reply.
_ACQUIRE = lua("ratelimit_lib", "ratelimit_acquire")
_SETTLE = lua("ratelimit_lib", "ratelimit_settle")
_THROTTLED = lua("ratelimit_lib", "ratelimit_throttled")
_REMAINING = lua("ratelimit_lib", "ratelimit_remaining")


class RateLimiter:
    """The fleet's buckets, one per configured model prefix, under one key prefix."""

    def __init__(self, redis: Redis, keys: Keys, limits: Mapping[str, RateLimit]) -> None:
        self.redis = redis
        self.keys = keys
        self.table = RateLimitTable(limits)
        self._acquire = registered(redis, _ACQUIRE)
        self._settle = registered(redis, _SETTLE)
        self._throttled = registered(redis, _THROTTLED)
        self._remaining = registered(redis, _REMAINING)

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
                if as_str(out[0]) == "ok":
                    return Grant(name, input_tokens, output_tokens, time.monotonic() - started)
                hint = as_str(out[1])
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
        return {as_str(k): as_str(v) for k, v in raw.items()}

