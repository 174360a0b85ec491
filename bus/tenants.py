"""Tenants: the teams a fleet serves, each with one pool every one of its goals draws from.

A goal names its tenant (`Goal.tenant`, default `default`). Its books (`bus.ledger`) remember it,
and every reservation of the goal also draws from the tenant's pool of the current period, in the
same Lua script as the goal's own reservation: no tenant spends past its pool, however many goals
and workers run.

Settings (`Keys.tenant(name)`, changed atomically by `Tenants.set`):
* `period`: `none` (one pool for ever), `day` or `month` (UTC calendar). Each period has its own
  books, the pool `tenant:<name>:<label>` (`all`, `2026-11-30`, `2026-11`).
* `budget_tokens` and/or `budget_usd` (0 = no limit of that unit). The reserve script reads them
  whenever a goal takes a grant of the pool (`bus.ledger`, module doc: grants), and `set` ends every
  grant of the tenant's goals, so lowering them takes effect at the next reservation; below what
  the period has already spent it refuses every new reservation, and touches nothing else (the
  books keep balancing, open reservations still settle).
* `max_running`: how many of the tenant's task attempts may run at once (0 = no limit). An
  executor takes a slot before it starts an attempt (`acquire_slot`); when none is free the job is
  deferred (`TenantBusy`) and runs again shortly; nothing fails for it.

A tenant without settings has no limits, but its spend is still kept per period (`none`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from .keys import Keys
from .ledger_records import TENANT_NAME_PATTERN, LedgerSnapshot, per_model
from .prices import usd_to_micro
from .replies import as_str, str_pairs
from .scripts import lua, registered

Period = Literal["none", "day", "month"]
KINDS = ("input", "output", "cache_read", "cache_write", "unknown")


def check_name(name: str) -> str:
    if not re.match(TENANT_NAME_PATTERN, name):
        raise ValueError(f"tenant name {name!r} does not match {TENANT_NAME_PATTERN}")
    return name


def period_label(period: str | None, at: datetime) -> str:
    """The label of the period `at` falls in (UTC calendar); the reserve script has the same rule."""
    at = at.astimezone(UTC)
    if period == "day":
        return at.strftime("%Y-%m-%d")
    if period == "month":
        return at.strftime("%Y-%m")
    return "all"


class TenantBusy(Exception):
    """Every running slot of the tenant is taken: the job is deferred (not failed) and tried again."""

    def __init__(self, tenant: str, running: int, limit: int, retry_in: float = 2.0) -> None:
        super().__init__(f"tenant {tenant!r} runs {running} tasks (max_running {limit}); retrying in {retry_in:g} s")
        self.tenant = tenant
        self.running = running
        self.limit = limit
        self.retry_in = retry_in

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tenant, self.running, self.limit, self.retry_in))


class TenantSettings(BaseModel):
    """A tenant's pool as set by an operator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    period: Period = "none"
    budget_tokens: int = Field(default=0, ge=0, description="tokens per period; 0 = no token limit")
    budget_usd: float = Field(default=0, ge=0, description="USD per period; 0 = no dollar limit")
    max_running: int = Field(default=0, ge=0, description="concurrent running task attempts; 0 = no limit")


class ModelSpend(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    unknown: int = Field(default=0, description="forfeited/expired reservations, counted in full")
    cost_usd: float = 0.0


class PeriodSpend(BaseModel):
    """One period's books of a tenant, with the spend per model and kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    books: LedgerSnapshot
    models: list[ModelSpend]
    resets: int = 0


class TenantView(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    settings: TenantSettings
    configured: bool = Field(description="False when the tenant has no settings (no limits)")
    current: str = Field(description="label of the current period")
    running: int = Field(description="task attempts holding a running slot now")
    periods: list[PeriodSpend]


def _decode(h: Mapping[Any, Any]) -> dict[str, str]:
    return {as_str(k): as_str(v) for k, v in h.items()}


def _model_spend(h: Mapping[str, str]) -> list[ModelSpend]:
    return [
        ModelSpend(
            model=m,
            **{k: v.get(k, 0) for k in KINDS},
            cost_usd=v.get("cost", 0) / 1_000_000,
        )
        for m, v in sorted(per_model(h).items())
    ]


# The scripts (bus/lua/): each file's header says its KEYS, ARGV and reply.
_SET = lua("ledger_lib", "tenants_set")
_RESET = lua("ledger_lib", "tenants_reset")
_REPORT = lua("ledger_lib", "tenants_report")
_ACQUIRE = lua("tenants_acquire")


class Tenants:
    """Admin and runtime access to tenants' settings, periods and running slots."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._set = registered(redis, _SET)
        self._reset = registered(redis, _RESET)
        self._report = registered(redis, _REPORT)
        self._acquire = registered(redis, _ACQUIRE)

    async def set(
        self,
        name: str,
        *,
        period: Period | None = None,
        budget_tokens: int | None = None,
        budget_usd: float | None = None,
        max_running: int | None = None,
    ) -> TenantSettings:
        """Change the given settings (the others keep their value) in one atomic step."""
        check_name(name)
        # Validates every value (ranges, period) before anything is written.
        TenantSettings(
            name=name,
            period=period or "none",
            budget_tokens=budget_tokens or 0,
            budget_usd=budget_usd or 0,
            max_running=max_running or 0,
        )
        args = [
            period or "",
            "" if budget_tokens is None else str(budget_tokens),
            "" if budget_usd is None else str(usd_to_micro(budget_usd)),  # exact integers in Redis
            "" if max_running is None else str(max_running),
            name,
        ]
        out = await self._set(keys=[self.keys.tenant(name), self.keys.tenants()], args=args)
        return self._settings(name, str_pairs(out))

    def _settings(self, name: str, h: Mapping[str, str]) -> TenantSettings:
        return TenantSettings(
            name=name,
            period=h.get("period", "none"),
            budget_tokens=int(h.get("budget_tokens") or 0),
            budget_usd=int(h.get("budget_micro") or 0) / 1_000_000,
            max_running=int(h.get("max_running") or 0),
        )

    async def names(self) -> list[str]:
        return sorted(as_str(n) for n in await self.redis.smembers(self.keys.tenants()))  # type: ignore[misc]

    async def show(self, name: str, periods: int = 12) -> TenantView:
        """Settings, running slots and the books of the last `periods` periods (newest first)."""
        check_name(name)
        h = _decode(await self.redis.hgetall(self.keys.tenant(name)))  # type: ignore[misc]
        settings = self._settings(name, h)
        sec, usec = await self.redis.time()
        now = sec + usec / 1_000_000
        current = period_label(settings.period, datetime.fromtimestamp(now, UTC))
        await self.redis.zremrangebyscore(self.keys.tenant_running(name), "-inf", now)
        running = int(await self.redis.zcard(self.keys.tenant_running(name)))
        # The goals' grants are reported first: the pools then hold every settled call's spend.
        await self.report(name)
        labels = [as_str(x) for x in await self.redis.zrevrange(self.keys.tenant_periods(name), 0, periods - 1)]
        out: list[PeriodSpend] = []
        for pool in labels:
            ph = _decode(await self.redis.hgetall(self.keys.pool(pool)))  # type: ignore[misc]
            if not ph:
                continue
            out.append(
                PeriodSpend(
                    label=pool.rsplit(":", 1)[1],
                    books=LedgerSnapshot.from_hash(pool, ph),
                    models=_model_spend(ph),
                    resets=int(ph.get("resets") or 0),
                )
            )
        return TenantView(settings=settings, configured=bool(h), current=current, running=running, periods=out)

    async def report(self, name: str) -> int:
        """Report every grant the tenant's goals hold to its pool (they go on); returns how many."""
        check_name(name)
        return int(await self._report(keys=[self.keys.tenant_grants(name)], args=[]))

    async def reset(self, name: str) -> str:
        """Start the tenant's current period afresh (its spend back to zero); returns the pool name."""
        check_name(name)
        return as_str(await self._reset(keys=[self.keys.tenant(name)], args=[self.keys.pool_prefix(), name]))

    async def acquire_slot(self, name: str, member: str, ttl: float) -> None:
        """Take (or renew, for `ttl` seconds) one of the tenant's running slots; `TenantBusy` if full."""
        out = await self._acquire(keys=[self.keys.tenant_running(name), self.keys.tenant(name)], args=[member, ttl])
        if int(out[0]) != 1:
            raise TenantBusy(name, int(out[1]), int(out[2]))

    def acquire_slot_in(self, pipe: Any, name: str, member: str, ttl: float) -> Any:
        """Queue a renewal of the slot on `pipe` (bus.renewals batches them); a full tenant's reply
        says busy and changes nothing. Returns the script, which must be loaded on the server."""
        pipe.evalsha(self._acquire.sha, 2, self.keys.tenant_running(name), self.keys.tenant(name), member, ttl)
        return self._acquire

    async def release_slot(self, name: str, member: str) -> None:
        await self.redis.zrem(self.keys.tenant_running(name), member)

