"""Who retries what, decided in one place.

Two layers retry model calls, each for its own kind of trouble:

* the `anthropic` SDK retries a blip inside one call (`TASKLOOM_MODEL_MAX_RETRIES`, a few seconds,
  honouring `retry-after`);
* the job layer survives an outage: a handler that meets a transient model error
  (`RetryableModelError`, `ModelTimeoutError`, `ModelConnectionError`) lets it escape, and the job
  wrapper (`taskloom.workers`) re-runs the same job later (arq `Retry`, same job id) with
  exponential backoff and jitter, never sooner than the provider's `retry-after`. The goal's
  patience (`TASKLOOM_PROVIDER_PATIENCE`) is counted from the first failure of the current trouble,
  shared by all of the goal's jobs, and reset by its next successful call. Past it, or at once for
  a terminal model error, the goal ends `failed` with a reason naming the error and its request id.

Every other exception that escapes a handler (a bug, a race, a corrupted record) is re-run a few
times with backoff (handlers are idempotent), then fails the goal with a reason; a lost Redis
connection is re-run without limit. Nothing escapes to arq as a silent failure.

This module holds the pure decisions and the small clock of a goal's provider trouble.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis.exceptions
from redis.asyncio import Redis

from llm.errors import ModelError

from .durability import NotReplicated
from .keys import Keys
from .scripts import lua, registered


@dataclass(frozen=True)
class RetryPolicy:
    # The defaults of TASKLOOM_PROVIDER_PATIENCE and TASKLOOM_PROVIDER_BACKOFF_MAX (taskloom.settings).
    patience: float = 900  # seconds a goal tolerates provider trouble
    base: float = 1.0  # first backoff, seconds
    cap: float = 30  # longest backoff, seconds
    internal_tries: int = 5  # tries of a job failing with an unexpected exception before its goal fails


@dataclass(frozen=True)
class RetryLater:
    delay: float  # seconds


@dataclass(frozen=True)
class GiveUp:
    reason: str


Decision = RetryLater | GiveUp


def backoff(tries: int, policy: RetryPolicy, rng: random.Random | None = None) -> float:
    """Exponential backoff with jitter: between half and all of `base * 2^(tries-1)`, capped."""
    ceiling = min(policy.cap, policy.base * 2 ** max(0, min(tries - 1, 30)))
    return (rng or random).uniform(ceiling / 2, ceiling)


def describe(exc: ModelError) -> str:
    """The provider error as an operator needs it: class, message, status and request id."""
    parts = [f"status={exc.status}" if exc.status is not None else "", f"request_id={exc.request_id or 'none'}"]
    return f"{type(exc).__name__}: {exc.message} ({', '.join(p for p in parts if p)})"


def on_model_error(
    exc: ModelError, tries: int, trouble_seconds: float, policy: RetryPolicy, rng: random.Random | None = None
) -> Decision:
    """What the job layer does about a model error that escaped a handler.

    `tries` is the job's try number (1 for its first run); `trouble_seconds` how long the goal has
    been in provider trouble, this failure included.
    """
    if not exc.retryable:
        return GiveUp(f"model error that retrying cannot fix: {describe(exc)}")
    left = policy.patience - trouble_seconds
    if left <= 0:
        waited = f"provider trouble for {trouble_seconds:.0f} s (patience {policy.patience:g} s)"
        return GiveUp(f"{waited}; last error: {describe(exc)}")
    delay = max(backoff(tries, policy, rng), exc.retry_after or 0.0)
    # The last try lands at the end of the patience, not past it.
    return RetryLater(min(delay, max(left, 0.1)))


def redis_trouble(exc: BaseException) -> str | None:
    """What kind of Redis trouble `exc` is, or None when it is none: "memory_full" (maxmemory reached
    under noeviction: writes refused with OOM until memory is freed), "read_only" (a replica or a
    demoted master), "not_replicated" (a guarded write no replica confirmed in time,
    `bus.durability.NotReplicated`), "unreachable" (away, restarting, failing over, loading its
    AOF). A job meeting any of them must simply run again.

    redis-py strips the code of the errors it maps to a class (OOM, READONLY), hence the classes; an
    error raised inside a Lua script may arrive wrapped, hence the text.
    """
    text = str(exc)
    if isinstance(exc, NotReplicated):
        return "not_replicated"
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM command not allowed" in text:
        return "memory_full"
    if isinstance(exc, redis.exceptions.ReadOnlyError) or "READONLY You can't write" in text:
        return "read_only"
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError | OSError):
        return "unreachable"
    if isinstance(exc, redis.exceptions.ResponseError) and text.startswith(("MASTERDOWN", "TRYAGAIN", "NOREPLICAS")):
        return "unreachable"
    return None


def is_redis_trouble(exc: BaseException) -> bool:
    """Redis is away or refuses writes for now (`redis_trouble`): the job must simply run again."""
    return redis_trouble(exc) is not None


@dataclass
class Episode:
    """Tells the first occurrence of a trouble from its repeats, so that an outage is logged once
    when it begins, not once per job: an occurrence after `quiet` seconds without one starts a new
    episode."""

    quiet: float = 30.0
    last: float | None = None

    def seen(self, now: float) -> bool:
        """Note an occurrence at `now` (monotonic seconds); True if it starts an episode."""
        new = self.last is None or now - self.last > self.quiet
        self.last = now
        return new


def on_other_error(exc: BaseException, tries: int, policy: RetryPolicy, rng: random.Random | None = None) -> Decision:
    """An exception that is not a model error escaped a handler."""
    if is_redis_trouble(exc):
        return RetryLater(backoff(tries, policy, rng))
    if tries < policy.internal_tries:
        return RetryLater(backoff(tries, policy, rng))
    return GiveUp(f"internal error after {tries} tries: {type(exc).__name__}: {exc}"[:2000])


class TroubleClock:
    """When a goal's current provider trouble began: set by its first failure, cleared by a success."""

    # The clock is the field `trouble_since` (ms, 0 = no trouble) of the goal's ledger books: every
    # successful call settles there anyway, and resets it in that same write (`Ledger.settle`).
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._failed = registered(redis, lua("retry_failed"))  # bus/lua/retry_failed.lua

    async def failed(self, goal_id: str, now_ms: int) -> int:
        """Record a failure at `now_ms`; return when the current trouble began (ms)."""
        since = await self._failed(keys=[self.keys.ledger(goal_id)], args=[now_ms])
        return int(since)


async def count_job_error(redis: Redis, keys: Keys, job_id: str) -> int:
    """Count one unexpected error of a job (kept a day); returns how many it has had. Counted apart
    from arq's try number, which also counts provider retries and crash re-runs."""
    key = keys.job_errors(job_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.expire(key, 24 * 3600)
        count, _ = await pipe.execute()
    return int(count)
