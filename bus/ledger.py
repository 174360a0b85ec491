"""The token-budget ledger: one set of books per goal in Redis, shared by every worker of the goal.

Protocol, per model call: `reserve` the worst case (input estimate + `max_tokens`) before the call,
then `settle` it with the usage the provider reported, `release` it when the call never reached the
provider, or `forfeit` it (count it in full) when the outcome is unknown. A reservation whose holder
died is forfeited when it expires: unknown is counted as spent, never as free.

Layout (one Redis, never Cluster: the scripts touch keys they read from the books, as bus/store.py
does):
* goal books, hash `Keys.ledger(goal_id)`: `budget`, `reserved`, `spent` (the total) and
  `spent_input`, `spent_output`, `spent_cache_read`, `spent_cache_write`, `spent_unknown`
  (forfeited and expired reservations), `calls`, `cost_micro_usd`, `refusals`, `open`, `releases`,
  `forfeits`, `expired`, `overrun`, `unpriced`, and `pools` (the pool names, one a line);
* pool books (per tenant, per day...), the same hash under `{prefix}pool:{name}`; a goal opened
  with a tenant also draws from the tenant's pool of the current period (`bus.tenants`);
* dollars beside tokens in every book: `budget_micro` (0/absent = no dollar limit),
  `reserved_micro` (worst-case cost held by open reservations) and `cost_micro_usd` (spent);
* open reservations: one global sorted set, scored by expiry time, whose members are the records
  (`id`, goal key, amount, forfeit cost, model, tenant pool key, pool keys, one a line); the
  reserving worker keeps the member (`Reservation.entry`) to close it. (An earlier version kept the
  records in a global hash `ledger:open`; the scripts still close such a reservation.) Global, so
  an expired reservation of a goal nobody touches any more is still swept by the next reserve that
  is short of room, by any snapshot, and by the supervisor's rounds, and its pools get their
  headroom back.

Every change is one Lua script, so the books always balance: `reserved` is the sum of the open
reservations' amounts and `spent` the sum of the kinds. The scripts never parse JSON; time comes
from Redis (`TIME`), so workers' clocks do not matter.

Budgets count tokens of every kind alike (a cache read is a token against the budget). Input
estimates (`llm.estimate`) are conservative: they err high. When usage still exceeds the
reservation, the truth is recorded as spent (and the excess as `overrun`); the output part can never
overrun, because the call is made with `max_tokens` clamped to the reservation.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from llm.types import Usage

from .durability import script_confirmed
from .events import CorruptRecord, first_error
from .keys import Keys
from .prices import PriceTable
from .replies import as_str, str_pairs
from .scripts import lua
from .store import NotFound

# Pool names end up inside Redis keys and inside newline-separated records.
POOL_NAME_PATTERN = r"^[A-Za-z0-9_.:@-]{1,128}$"
# Tenant names too, and inside pool names (`tenant:<name>:<period>`): no colon.
TENANT_NAME_PATTERN = r"^[A-Za-z0-9_.@-]{1,64}$"


def usd_to_micro(usd: float) -> int:
    """Dollars as integer micro-USD (rounded down: a budget never grows by rounding)."""
    return int(Decimal(str(usd)) * 1_000_000)


# Expired reservations closed per script call: bounds the time one reserve can spend sweeping.
SWEEP_BATCH = 100


def ledger_keys(keys: Keys) -> tuple[str, str, str]:
    """(open-reservations hash, expiry sorted set, pool key prefix)."""
    return keys.ledger_open(), keys.ledger_expiry(), keys.pool_prefix()


# -- errors ---------------------------------------------------------------------------------------


class LedgerError(Exception):
    """Base of the ledger's typed errors."""


class LedgerNotFound(LedgerError, NotFound):
    """The goal has no ledger: `open` was never called for it (or its books were deleted)."""

    def __init__(self, goal_id: str) -> None:
        NotFound.__init__(self, "ledger of goal", goal_id)
        self.goal_id = goal_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.goal_id,))


class BudgetExhausted(LedgerError):
    """A reservation was refused: spent + reserved + requested > budget, in the goal or in `pool`.

    `budget`, `spent` and `reserved` are the numbers of the books that refused (the pool's when
    `pool` is set); `requested` is the smallest reservation that would have been accepted (the input
    estimate plus the fewest output tokens worth a call).
    """

    def __init__(
        self,
        goal_id: str,
        budget: int,
        spent: int,
        reserved: int,
        requested: int,
        pool: str | None,
        unit: str = "tokens",
    ) -> None:
        where = f"pool {pool!r} of goal {goal_id}" if pool else f"goal {goal_id}"
        headroom = budget - spent - reserved
        if unit == "unpriced":
            msg = (
                f"dollar budget of {where} cannot be kept: the model has no price "
                "(add it to TASKLOOM_PRICES, USD per million tokens)"
            )
        elif unit == "usd":
            d = 1_000_000
            msg = (
                f"dollar budget exhausted for {where}: budget ${budget / d:.6f}, spent ${spent / d:.6f}, "
                f"reserved ${reserved / d:.6f}, headroom ${headroom / d:.6f} < ${requested / d:.6f} needed "
                "for this call at its dearest rates"
            )
        else:
            msg = (
                f"token budget exhausted for {where}: budget {budget}, spent {spent}, reserved {reserved}, "
                f"headroom {headroom} < {requested} needed for this call"
            )
        super().__init__(msg)
        self.goal_id = goal_id
        self.budget = budget
        self.spent = spent
        self.reserved = reserved
        self.requested = requested
        self.pool = pool
        self.unit = unit  # "tokens", or "usd" (then the numbers are micro-USD)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.goal_id, self.budget, self.spent, self.reserved, self.requested, self.pool, self.unit),
        )


# -- the clamp decision (pure; the reserve script implements the same rule) -----------------------


def min_output(max_tokens: int, min_reservation: int) -> int:
    """Fewest output tokens worth a call: `min_reservation`, or the request's own `max_tokens` if smaller."""
    return max(1, min(max_tokens, min_reservation))


def clamp_output(headroom: int, input_tokens: int, max_tokens: int, min_reservation: int) -> int:
    """Output tokens to reserve: `max_tokens` cut to what `headroom` leaves after the input estimate.

    0 means refuse: fewer than `min_output` tokens would be left for the answer.
    """
    out = min(max_tokens, headroom - input_tokens)
    return out if out >= min_output(max_tokens, min_reservation) else 0


# -- records --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolRef:
    """A shared budget goals draw from (e.g. `tenant:acme`, `day:2026-11-29`); created on first use."""

    name: str
    budget_tokens: int

    def __post_init__(self) -> None:
        if not re.match(POOL_NAME_PATTERN, self.name):
            raise ValueError(f"pool name {self.name!r} does not match {POOL_NAME_PATTERN}")
        if self.budget_tokens <= 0:
            raise ValueError(f"pool {self.name!r}: budget_tokens must be positive, got {self.budget_tokens}")


class Reservation(BaseModel):
    """Tokens set aside for one model call; settle, release or forfeit it exactly once (repeats are no-ops)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    goal_id: str
    input_tokens: int = Field(ge=0, description="the input estimate reserved")
    max_tokens: int = Field(gt=0, description="output tokens reserved: the call's max_tokens, clamped")
    amount: int = Field(gt=0, description="input_tokens + max_tokens")
    expires_at: float = Field(description="Redis time (epoch seconds) after which it is forfeited")
    pools: tuple[str, ...] = ()
    model: str | None = None
    cost_micro: int = Field(default=0, ge=0, description="worst-case micro-USD held (dearest rates)")
    tenant_pool: str | None = Field(default=None, description="the tenant's period pool it draws from")
    spent_fraction: float = Field(
        default=0.0, ge=0, description="the highest spent/budget among the books it draws from, before this call"
    )
    # Its entry in the expiry set (id, then the record of the books it holds, one a line): closing it
    # removes this entry, so the close script reads no record. "" for a reservation made by an earlier
    # version (closed by `id`).
    entry: str = ""


class LedgerSnapshot(BaseModel):
    """A goal's (or a pool's) books at one instant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="the goal id, or the pool name")
    budget: int = Field(description="token budget (0 for a pool without a token limit)")
    budget_micro_usd: int = Field(default=0, description="dollar budget in micro-USD (0 = none)")
    reserved_micro_usd: int = Field(default=0, description="worst-case cost held by open reservations")
    reserved: int
    spent: int
    spent_input: int
    spent_output: int
    spent_cache_read: int
    spent_cache_write: int
    spent_unknown: int = Field(description="forfeited and expired reservations, counted in full")
    usage_unknown: int = Field(default=0, description="calls whose reply carried no usage, counted in full")
    served_by: dict[str, str] = Field(
        default_factory=dict, description="the model that last served each role's calls (role -> model)"
    )
    calls: int
    cost_micro_usd: int
    cost_usd: float
    headroom: int = Field(description="budget - spent - reserved")
    refusals: int
    open: int = Field(description="reservations not yet settled, released or expired")
    releases: int
    forfeits: int
    expired: int
    overrun: int = Field(description="tokens settled above their reservation (input estimate too low)")
    unpriced: int = Field(description="settled calls whose model has no price (cost counted as 0)")
    pools: list[str]

    @classmethod
    def from_hash(cls, name: str, h: Mapping[str, str]) -> LedgerSnapshot:
        def n(field: str) -> int:
            return int(h.get(field) or 0)

        budget, spent, reserved = n("budget"), n("spent"), n("reserved")
        return cls(
            name=name,
            budget=budget,
            budget_micro_usd=n("budget_micro"),
            reserved_micro_usd=n("reserved_micro"),
            reserved=reserved,
            spent=spent,
            spent_input=n("spent_input"),
            spent_output=n("spent_output"),
            spent_cache_read=n("spent_cache_read"),
            spent_cache_write=n("spent_cache_write"),
            spent_unknown=n("spent_unknown"),
            usage_unknown=n("usage_unknown"),
            served_by={k.removeprefix("served:"): v for k, v in h.items() if k.startswith("served:")},
            calls=n("calls"),
            cost_micro_usd=n("cost_micro_usd"),
            cost_usd=n("cost_micro_usd") / 1_000_000,
            headroom=budget - spent - reserved,
            refusals=n("refusals"),
            open=n("open"),
            releases=n("releases"),
            forfeits=n("forfeits"),
            expired=n("expired"),
            overrun=n("overrun"),
            unpriced=n("unpriced"),
            pools=[p for p in (h.get("pools") or "").split("\n") if p],
        )


# -- Lua (bus/lua/*.lua; each file's header says its KEYS, ARGV and reply) ------------------------

_OPEN = lua("ledger_open")
_RESERVE = lua("ledger_lib", "ledger_reserve")
_CLOSE = lua("ledger_lib", "ledger_close")
_SWEEP = lua("ledger_lib", "ledger_sweep")


# -- the ledger -----------------------------------------------------------------------------------


class Ledger:
    """The books of every goal and pool under one key prefix. Cheap to build; share one per process."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        min_reservation: int = 256,
        reservation_ttl: float = 600,
        prices: PriceTable | None = None,
    ) -> None:
        if min_reservation < 1:
            raise ValueError(f"min_reservation must be at least 1, got {min_reservation}")
        if reservation_ttl <= 0:
            raise ValueError(f"reservation_ttl must be positive, got {reservation_ttl}")
        self.redis = redis
        self.keys = keys
        self.min_reservation = min_reservation
        self.reservation_ttl = reservation_ttl
        self.prices = prices or PriceTable()
        self._open_key, self._expiry_key, self._pool_prefix = ledger_keys(keys)
        self._open = redis.register_script(_OPEN)
        self._reserve = redis.register_script(_RESERVE)
        self._close = redis.register_script(_CLOSE)
        self._sweep = redis.register_script(_SWEEP)

    async def open(
        self,
        goal_id: str,
        budget_tokens: int,
        pools: Sequence[PoolRef] = (),
        *,
        budget_usd: float | None = None,
        tenant: str | None = None,
    ) -> bool:
        """Create the goal's books (idempotent: False, and nothing changed, if they exist).

        Each pool's books are created with `budget_tokens` the first time any goal names it; an
        existing pool keeps its budget. `budget_usd` adds a dollar limit beside the token one;
        `tenant` makes every reservation also draw from the tenant's pool of the current period
        (`bus.tenants`), in the same script.
        """
        if budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be positive, got {budget_tokens}")
        if budget_usd is not None and budget_usd <= 0:
            raise ValueError(f"budget_usd must be positive, got {budget_usd}")
        if tenant is not None and not re.match(TENANT_NAME_PATTERN, tenant):
            raise ValueError(f"tenant {tenant!r} does not match {TENANT_NAME_PATTERN}")
        micro = 0 if budget_usd is None else usd_to_micro(budget_usd)
        args: list[str | int] = [budget_tokens, self._pool_prefix, micro, tenant or ""]
        for pool in pools:
            args += [pool.name, pool.budget_tokens]
        return bool(await self._open(keys=[self.keys.ledger(goal_id)], args=args))

    async def reserve(
        self, goal_id: str, estimated_input: int, max_tokens: int, *, model: str | None = None
    ) -> Reservation:
        """Set aside `estimated_input` + `max_tokens` (clamped to the headroom) for one call.

        When the call cannot have its full `max_tokens`, expired reservations are swept first and the
        call decided again, in the same atomic step. `model` prices the reservation
        should it be forfeited. Raises `BudgetExhausted` when fewer than `min(max_tokens,
        min_reservation)` output tokens would be left, in the goal or any of its pools, and
        `LedgerNotFound` when the goal's books were never opened.
        """
        if estimated_input < 0 or max_tokens < 1:
            raise ValueError(f"need estimated_input >= 0 and max_tokens >= 1, got {estimated_input}, {max_tokens}")
        rid = uuid.uuid4().hex
        price_in, price_out = self.prices.per_mtok_micro(model, estimated_input)
        # The model is a line of the reservation's record and part of field names: no whitespace.
        model_tag = "-" if model is None else re.sub(r"\s", "_", model)[:200] or "-"
        # Replicated (`bus.durability`) before the call is made: a reservation lost in a failover
        # would make its settle find nothing to close, and the call's spending would go uncounted.
        out = await script_confirmed(
            self.redis,
            "ledger reserve",
            self._reserve,
            [self.keys.ledger(goal_id), self._open_key, self._expiry_key],
            [
                rid,
                estimated_input,
                max_tokens,
                self.min_reservation,
                self.reservation_ttl,
                price_in,
                price_out,
                self._pool_prefix,
                SWEEP_BATCH,
                model_tag,
                int(self.prices.priced(model)),
                self.keys.tenant(""),
            ],
        )
        status = as_str(out[0])
        if status == "missing":
            raise LedgerNotFound(goal_id)
        if status == "refused":
            pool, unit = as_str(out[1]), as_str(out[2])
            budget, spent, reserved, requested = (int(float(as_str(v))) for v in out[3:7])
            raise BudgetExhausted(goal_id, budget, spent, reserved, requested, pool or None, unit)
        return Reservation(
            id=rid,
            goal_id=goal_id,
            input_tokens=estimated_input,
            max_tokens=int(as_str(out[1])),
            amount=int(as_str(out[2])),
            expires_at=float(as_str(out[3])),
            pools=tuple(p for p in as_str(out[4]).split("\n") if p),
            model=model,
            cost_micro=int(as_str(out[5])),
            tenant_pool=as_str(out[6]) or None,
            spent_fraction=int(as_str(out[7])) / 1000,
            entry=as_str(out[8]),
        )

    async def settle(
        self,
        reservation: Reservation,
        usage: Usage,
        *,
        model: str | None = None,
        end_trouble: bool = False,
        served: tuple[str, str] | None = None,
    ) -> int:
        """Record what the call really used (priced for `model`, e.g. `ModelResponse.model`).

        Truthy if this closed the reservation (2: and `served` changed the role's model, 1: it did
        not); 0 (nothing changed) if it was already settled,
        released, forfeited or expired: a retried settle, or one that arrives after expiry
        already counted the full amount. `end_trouble`: a successful call ends the goal's provider
        trouble (`bus.retry.TroubleClock`); its clock is reset in the same write as the books.
        `served`: (role, model) recorded on the goal's books in the same write (`served_by`).
        """
        cost = self.prices.cost(model or reservation.model, usage)
        return await self._close_one(
            reservation,
            "settle",
            end_trouble,
            served,
            usage.input_tokens,
            usage.output_tokens,
            usage.cache_read_tokens,
            usage.cache_write_tokens,
            cost or 0,
            int(cost is None),
        )

    async def release(self, reservation: Reservation) -> bool:
        """Free the reservation: the call never reached the provider. Idempotent like `settle`."""
        return bool(await self._close_one(reservation, "release", False, None))

    async def forfeit(self, reservation: Reservation) -> bool:
        """Count the full reservation as spent: the call's outcome is unknown (timeout, cancellation)."""
        return bool(await self._close_one(reservation, "forfeit", False, None))

    async def settle_unknown(
        self, reservation: Reservation, *, end_trouble: bool = False, served: tuple[str, str] | None = None
    ) -> int:
        """The call succeeded but its reply carried no usage (some local servers): count the full
        reservation as spent at its worst-case cost, as `usage_unknown`, never as free."""
        return await self._close_one(reservation, "unknown", end_trouble, served)

    async def _close_one(
        self, reservation: Reservation, mode: str, end_trouble: bool, served: tuple[str, str] | None, *usage: int
    ) -> int:
        field, value = (f"served:{served[0]}", served[1]) if served is not None else ("", "")
        # Replicated (`bus.durability`): a close lost with its reservation would leave spending uncounted.
        out = await script_confirmed(
            self.redis,
            f"ledger {mode}",
            self._close,
            [self._open_key, self._expiry_key],
            [reservation.entry or reservation.id, mode, int(end_trouble), field, value, *usage],
        )
        return int(out)

    async def sweep(self) -> int:
        """Forfeit every expired reservation (of any goal under this prefix); returns how many."""
        total = 0
        while True:
            out = await self._sweep(keys=[self._open_key, self._expiry_key], args=[SWEEP_BATCH])
            n = int(out[0])
            total += n
            if n < SWEEP_BATCH:
                return total

    async def snapshot(self, goal_id: str) -> LedgerSnapshot:
        """The goal's books, after forfeiting expired reservations. `LedgerNotFound` if never opened."""
        key = self.keys.ledger(goal_id)
        try:
            h = await self._read(key)
            if "budget" not in h:
                raise LedgerNotFound(goal_id)
            return LedgerSnapshot.from_hash(goal_id, h)
        except (ResponseError, ValueError, TypeError) as exc:  # a field that is no number, a key of another type
            raise CorruptRecord("ledger", key, first_error(exc)) from None

    async def pool_snapshot(self, name: str) -> LedgerSnapshot | None:
        """A pool's books (None if no goal has used it yet)."""
        h = await self._read(self.keys.pool(name))
        return LedgerSnapshot.from_hash(name, h) if "budget" in h else None

    async def _read(self, key: str) -> dict[str, str]:
        out = await self._sweep(keys=[self._open_key, self._expiry_key, key], args=[SWEEP_BATCH])
        return str_pairs(out[1:])
