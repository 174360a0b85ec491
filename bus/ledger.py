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
  reserving worker keeps the member (`Reservation.entry`) to close it. (A member that is a bare id
  keeps its record in the global hash `ledger:open`, as older workers wrote it; the scripts close both
  forms.) Global, so
  an expired reservation of a goal nobody touches any more is still swept by the next reserve that
  is short of room, by any snapshot, and by the supervisor's rounds, and its pools get their
  headroom back.

Every change is one Lua script, so the books always balance: `reserved` is the sum of the open
reservations' amounts and `spent` the sum of the kinds. The scripts never parse JSON; time comes
from Redis (`TIME`), so workers' clocks do not matter.

Held settles (`settle_later`): an executor's call does not settle on its own. Its settle is held in
the process and rides on the next write that can carry it: the attempt's next write (`held_call`,
used by `bus.attempts.AttemptStore`: the step stored right after the call, in the same round trip),
or the process's next reserve (the closes run first, then the reserve, in one script). Either way a
call costs one round trip instead of two. What nothing picks up is sent on its own after
`settle_delay` seconds, or by `flush`, which the executor awaits before it stores a result, so the
books are exact whenever a result is. Until then the call's whole reservation stays held: never a
token over any budget, but a reserve from another process may find less room for that moment. A
crash loses the held settles; their reservations are forfeited in full when they expire, counted as
spent, never as free.

Grants (a tenant's goals): booking the tenant's period pool on every call took about as much of
Redis's time as the goal's own books. A goal instead takes a grant from the pool on its first call
(the reserve's slow path: the tenant's settings and the pool read, the pool's `reserved` raised by
the call and by up to 16 more like it (`GRANT_CALLS` in `bus/lua/ledger_reserve.lua`), each grant at
most a quarter of what the pool has left shared among the goals holding grants), and its later calls
reserve and settle against the grant in the goal's books alone (the fast path: one field more read;
a call of another model than the grant's keeps its spend per model apart, `tm:<model>:<kind>`, until
reported). The grant's record is the goal's field `tg` (`bus/lua/ledger_lib.lua` says its lines).
The goal *reports* its grant to the pool (its counters' growth, spend, spend per model; what it
holds beyond its calls in flight goes back) when the grant cannot carry a call, when its period
ends, when another goal of the tenant finds the pool short (`reclaim`, of up to `RECLAIM` (32) other
grants picked at random: with at most 32 holders no call refuses or clamps for tokens a grant holds
unused), when the tenant is read or reset, when its settings change (`Tenants.set`: the grants end,
so new limits bind the next call), and before retention deletes the goal's books (`end_grant`). The
pool always holds every grant in full: never a token over any budget. A call in flight when its
grant ended (period over, settings changed) is closed on its own pool when it settles, as a call of
an older worker is. Workers of an older version serving the same tenant's goal at once (a rolling
upgrade) can make the pool count a few calls twice or hold a call's tokens until the period ends:
never too few (a few calls' spend per model may be missing).

Budgets count tokens of every kind alike (a cache read is a token against the budget). Input
estimates (`llm.estimate`) are conservative: they err high. When usage still exceeds the
reservation, the truth is recorded as spent (and the excess as `overrun`); the output part can never
overrun, because the call is made with `max_tokens` clamped to the reservation.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache

import structlog
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from llm.types import Usage

from .batch import ScriptCall
from .durability import policy_of, script_confirmed
from .events import CorruptRecord, first_error
from .keys import Keys
from .ledger_records import (
    POOL_NAME_PATTERN,
    TENANT_NAME_PATTERN,
    BudgetExhausted,
    LedgerError,
    LedgerNotFound,
    LedgerSnapshot,
    PoolRef,
    Reservation,
    reservation_from_reply,
)
from .prices import PriceTable, usd_to_micro
from .replies import str_pairs
from .scripts import library, lua, registered

log = structlog.get_logger("taskloom.ledger")

# Expired reservations closed per script call: bounds the time one reserve can spend sweeping.
SWEEP_BATCH = 100
# Held settles closed per script call (the rest ride on the next one).
FOLD_BATCH = 100
# A held settle whose close failed this many times (Redis unreachable) is given up: its reservation
# is forfeited in full when it expires.
FOLD_TRIES = 3
# The defaults of TASKLOOM_LEDGER_MIN_RESERVATION and TASKLOOM_LEDGER_RESERVATION_TTL (taskloom.settings).
MIN_RESERVATION = 256
RESERVATION_TTL: float = 600
# The default of TASKLOOM_LEDGER_SETTLE_DELAY: how long a held settle waits for a reserve to ride on.
SETTLE_DELAY: float = 0.25


def ledger_keys(keys: Keys) -> tuple[str, str, str]:
    """(open-reservations hash, expiry sorted set, pool key prefix)."""
    return keys.ledger_open(), keys.ledger_expiry(), keys.pool_prefix()


@lru_cache(maxsize=256)
def model_tag(model: str | None) -> str:
    """The model as a line of a reservation's record and part of field names: no whitespace."""
    return "-" if model is None else re.sub(r"\s", "_", model)[:200] or "-"


@lru_cache(maxsize=4)
def day_hint(day: int) -> tuple[str, int]:
    """The reserve script's hint of the current UTC day (number `day` since the epoch): its label
    and first second. The script checks it against Redis's clock, so a wrong worker clock costs
    only the hint, never a wrong period."""
    start = day * 86400
    return datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%d"), start


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


# -- Lua (bus/lua/*.lua; each file's header says its KEYS, ARGV and reply) ------------------------

_OPEN = lua("ledger_open")
# The scripts that share ledger_lib.lua, also a library of Redis Functions (`bus.scripts.library`).
_LIB = library(
    "ledger",
    "ledger_lib",
    {
        "reserve": ("ledger_reserve_args", "ledger_reserve"),
        "fold": ("ledger_fold", "ledger_reserve"),
        "close": ("ledger_close",),
        "close_many": ("ledger_close_many",),
        "sweep": ("ledger_sweep",),
        "end_grant": ("ledger_release",),
    },
)
_RESERVE = _LIB["reserve"]
_FOLD = _LIB["fold"]
_CLOSE = _LIB["close"]
_CLOSE_MANY = _LIB["close_many"]
_SWEEP = _LIB["sweep"]
_END_GRANT = _LIB["end_grant"]


async def end_grant(redis: Redis, keys: Keys, goal_id: str) -> bool:
    """`Ledger.end_grant` for a caller without a ledger (`bus.store` ends the grant of a goal that ends)."""
    return bool(await registered(redis, _END_GRANT)(keys=[keys.ledger(goal_id)], args=[keys.tenant("")]))


@dataclass
class _Held:
    """A settle held back (`Ledger.settle_later`): the close script's ARGV, and who is told its reply."""

    args: list[str | int]
    reservation: Reservation
    then: Callable[[int], None] | None
    tries: int = 0


def fold_args(held: Sequence[_Held]) -> list[str | int]:
    """The closes' part of the fold and close-many scripts' ARGV: their number, then each as a count
    and its arguments."""
    out: list[str | int] = [len(held)]
    for h in held:
        out += [len(h.args), *h.args]
    return out


# -- the ledger -----------------------------------------------------------------------------------


class Ledger:
    """The books of every goal and pool under one key prefix. Cheap to build; share one per process."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        min_reservation: int = MIN_RESERVATION,
        reservation_ttl: float = RESERVATION_TTL,
        prices: PriceTable | None = None,
        settle_delay: float = 0.0,
    ) -> None:
        """`settle_delay`: the longest a held settle waits for a reserve to ride on (`settle_later`);
        0 settles each call on its own."""
        if settle_delay < 0:
            raise ValueError(f"settle_delay must be >= 0, got {settle_delay}")
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
        self._tenant_prefix = keys.tenant("")
        self._open = registered(redis, _OPEN)
        self._reserve = registered(redis, _RESERVE)
        self._close = registered(redis, _CLOSE)
        self._sweep = registered(redis, _SWEEP)
        self._fold = registered(redis, _FOLD)
        self._close_many = registered(redis, _CLOSE_MANY)
        self.settle_delay = settle_delay
        self._held: list[_Held] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()  # strong references to timer-started flushes

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

    def reserve_call(
        self, goal_id: str, estimated_input: int, max_tokens: int, model: str | None
    ) -> tuple[str, list[str], list[str | int | float]]:
        """The reserve script's (reservation id, KEYS, ARGV) for one call (see `reserve`)."""
        if estimated_input < 0 or max_tokens < 1:
            raise ValueError(f"need estimated_input >= 0 and max_tokens >= 1, got {estimated_input}, {max_tokens}")
        rid = os.urandom(16).hex()  # as unique as a uuid4's hex, at a fifth of its cost
        price_in, price_out = self.prices.per_mtok_micro(model, estimated_input)
        keys = [self.keys.ledger(goal_id), self._open_key, self._expiry_key]
        args: list[str | int | float] = [
            rid,
            estimated_input,
            max_tokens,
            self.min_reservation,
            self.reservation_ttl,
            price_in,
            price_out,
            self._pool_prefix,
            SWEEP_BATCH,
            model_tag(model),
            int(self.prices.priced(model)),
            self._tenant_prefix,
            *day_hint(int(time.time() // 86400)),
        ]
        return rid, keys, args

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
        rid, keys, args = self.reserve_call(goal_id, estimated_input, max_tokens, model)
        # Replicated (`bus.durability`) before the call is made: a reservation lost in a failover
        # would make its settle find nothing to close, and the call's spending would go uncounted.
        if not self._held:
            out = await script_confirmed(self.redis, "ledger reserve", self._reserve, keys, args)
            return reservation_from_reply(out, rid, goal_id, estimated_input, model)
        # The settles held in this process ride along, closed before the reserve decides: this
        # process's own held reservations never make it refuse.
        held = self._take()
        try:
            closed, out = await script_confirmed(
                self.redis, "ledger reserve", self._fold, keys, [*fold_args(held), *args]
            )
        except BaseException as exc:  # cancellation included: the closes may not have run
            self.held_done(held, exc)
            raise
        self.held_done(held, closed)
        return reservation_from_reply(out, rid, goal_id, estimated_input, model)

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
        usage_args = self.settled_usage(usage, model or reservation.model)
        return await self._close_one(reservation, "settle", end_trouble, served, *usage_args)

    async def settle_later(
        self,
        reservation: Reservation,
        usage: Usage,
        *,
        model: str | None = None,
        end_trouble: bool = False,
        served: tuple[str, str] | None = None,
        then: Callable[[int], None] | None = None,
    ) -> None:
        """`settle`, held back to ride on the next write that carries held settles (`held_call`) or
        this process's next reserve, or sent on its own within `settle_delay` seconds, or by `flush`
        (module doc: held settles). `then` is told the close's
        reply (as `settle` returns it) once it ran; it is not told when the close failed, which is
        logged (the reservation is then forfeited when it expires). With `settle_delay` 0, the
        settle runs now."""
        usage_args = self.settled_usage(usage, model or reservation.model)
        args = self.close_args(reservation, "settle", end_trouble, served, *usage_args)
        if self.settle_delay <= 0:
            closed = await self._close_args(args, "settle")
            if then is not None:
                then(closed)
            return
        self._held.append(_Held(args, reservation, then))
        self._arm()

    @property
    def held(self) -> int:
        """Settles held back, not yet sent (`settle_later`)."""
        return len(self._held)

    async def flush(self) -> None:
        """Send every held settle now. The books are exact after it (unless Redis could not be reached:
        then the settles stay held, and are tried again within `settle_delay`)."""
        while self._held:
            held = self._take()
            try:
                closed = await script_confirmed(
                    self.redis, "ledger settle", self._close_many, [self._open_key, self._expiry_key], fold_args(held)
                )
            except BaseException as exc:
                self.held_done(held, exc)
                if isinstance(exc, Exception):
                    return
                raise
            self.held_done(held, closed)

    def held_call(self) -> tuple[ScriptCall, list[_Held]] | None:
        """The held settles as one script call for another write's round trip (`bus.batch`), or None
        (nothing held, or a replica policy: a settle then goes out as a guarded write of its own).
        Hand back the call's reply, or what it raised, with `held_done`."""
        if not self._held or policy_of(self.redis).replicas:
            return None
        held = self._take()
        keys = [self._open_key, self._expiry_key]
        return ScriptCall(self._close_many, keys, fold_args(held)), held

    def held_done(self, held: list[_Held], reply: object) -> None:
        """The outcome of a `held_call`: the closes' replies, or the exception it raised or returned."""
        if isinstance(reply, BaseException):
            self._give_back(held, reply)
        else:
            self._tell(held, typing.cast(Sequence[object], reply))

    def _take(self) -> list[_Held]:
        # The timer stays armed: cancelling and re-arming it around every call cost more than a
        # timer that, when due, finds nothing to send.
        held, self._held = self._held[:FOLD_BATCH], self._held[FOLD_BATCH:]
        return held

    def _give_back(self, held: list[_Held], exc: BaseException) -> None:
        """Closes that may not have run: held again (closing twice is harmless), up to FOLD_TRIES."""
        kept = []
        for h in held:
            h.tries += 1
            if h.tries < FOLD_TRIES or isinstance(exc, asyncio.CancelledError):
                kept.append(h)
            else:
                # Given up: the reservation is forfeited at its full amount when it expires.
                log.warning(
                    "ledger.close_failed", goal_id=h.reservation.goal_id, reservation=h.reservation.id, error=repr(exc)
                )
        self._held[:0] = kept
        if self._held:
            self._arm()

    def _tell(self, held: list[_Held], replies: Sequence[object]) -> None:
        for h, reply in zip(held, replies, strict=True):
            if isinstance(reply, int):
                if h.then is not None:
                    h.then(reply)
                continue
            # The close failed inside Redis (books that hold no number): the others still closed.
            text = reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)
            log.warning("ledger.close_failed", goal_id=h.reservation.goal_id, reservation=h.reservation.id, error=text)

    def _arm(self) -> None:
        """Make sure a flush is due within `settle_delay` while settles are held."""
        if self._timer is None and self.settle_delay > 0:
            self._timer = asyncio.get_running_loop().call_later(self.settle_delay, self._due)

    def _due(self) -> None:
        self._timer = None
        if not self._held:
            return
        task = asyncio.ensure_future(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    def settled_usage(self, usage: Usage, model: str | None) -> list[int]:
        """The close script's usage arguments of a settle: tokens by kind, cost (micro-USD) and unpriced."""
        cost = self.prices.cost(model, usage)
        return [
            usage.input_tokens,
            usage.output_tokens,
            usage.cache_read_tokens,
            usage.cache_write_tokens,
            cost or 0,
            int(cost is None),
        ]

    def close_args(
        self, reservation: Reservation, mode: str, end_trouble: bool, served: tuple[str, str] | None, *usage: int
    ) -> list[str | int]:
        """The close script's ARGV (its KEYS: the open hash and the expiry set; see `settle`)."""
        field, value = (f"served:{served[0]}", served[1]) if served is not None else ("", "")
        return [reservation.entry or reservation.id, mode, int(end_trouble), field, value, *usage]

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
        return await self._close_args(self.close_args(reservation, mode, end_trouble, served, *usage), mode)

    async def _close_args(self, args: list[str | int], mode: str) -> int:
        # Replicated (`bus.durability`): a close lost with its reservation would leave spending uncounted.
        keys = [self._open_key, self._expiry_key]
        out = await script_confirmed(self.redis, f"ledger {mode}", self._close, keys, args)
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

    async def end_grant(self, goal_id: str) -> bool:
        """End the goal's grant from its tenant's pool, if it holds one (module doc: grants): its spend
        is reported and what it holds beyond the calls in flight goes back. True if it held one."""
        return await end_grant(self.redis, self.keys, goal_id)

    @staticmethod
    def end_grant_in(pipe: typing.Any, keys: Keys, goal_id: str) -> None:
        """Queue `end_grant` on a transaction (`MULTI`): sent as EVAL, so it needs no loaded script."""
        pipe.eval(_END_GRANT, 1, keys.ledger(goal_id), keys.tenant(""))

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

    async def _read(self, key: str) -> dict[str, str]:
        out = await self._sweep(keys=[self._open_key, self._expiry_key, key], args=[SWEEP_BATCH])
        return str_pairs(out[1:])


__all__ = [
    "MIN_RESERVATION",
    "POOL_NAME_PATTERN",
    "RESERVATION_TTL",
    "SETTLE_DELAY",
    "SWEEP_BATCH",
    "TENANT_NAME_PATTERN",
    "BudgetExhausted",
    "Ledger",
    "LedgerError",
    "LedgerNotFound",
    "LedgerSnapshot",
    "PoolRef",
    "Reservation",
    "clamp_output",
    "ledger_keys",
    "min_output",
]
