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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from llm.types import Usage

from .events import CorruptRecord, first_error
from .keys import Keys
from .prices import PriceTable
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


# -- Lua ------------------------------------------------------------------------------------------

# Shared by every script. A reservation's expiry entry is `id \n goal key \n amount \n forfeit cost \n
# model \n tenant pool key \n pool key...` (model and tenant pool are '-' when there is none).
# `close` takes one open reservation off the books (the goal's, the tenant period pool's, each pool's):
#   'settle'  spent += the reported usage (by kind), cost += the priced usage;
#   'release' nothing spent;
#   'forfeit' / 'expire' / 'unknown'  spent_unknown += the full amount, cost += the worst-case cost
#   ('unknown': the call succeeded but its reply carried no usage; counted as `usage_unknown`).
# Every book also gives back the worst-case cost it held (`reserved_micro`). The tenant period pool
# also keeps the spend per model (`m:<model>:<kind>`), for `taskloom ledger --tenant`.
# It returns false when the id is not open: closing is idempotent.
_LIB = """
local function lines(s)
  local out = {}
  for part in string.gmatch(s, '[^\\n]+') do out[#out + 1] = part end
  return out
end

local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local SETTLED = {'spent_input', 'spent_output', 'spent_cache_read', 'spent_cache_write', 'cost_micro_usd',
                 'unpriced'}
local KINDS = {'input', 'output', 'cache_read', 'cache_write', 'cost'}

-- Add `delta[i]` to the integer field `fields[i]` of hash `key`, for every i, in two commands (one
-- HMGET, one HSET) whatever the number of fields: a script's cost is mostly its redis.call count,
-- and one HINCRBY per field made a settle cost ~25 commands. Exact like HINCRBY for integers up to
-- 2^53 (token counts and micro-USD stay far below), and like HINCRBY it refuses a field that holds
-- no integer.
local function int_of(v, key, field)
  if not v then return 0 end
  local n = tonumber(v)
  if not n or n ~= math.floor(n) then error('hash value is not an integer: ' .. key .. ' ' .. field) end
  return n
end

-- `extra`: more field/value pairs to write in the same HSET.
local function add_all(key, fields, delta, extra)
  if #fields == 0 then return end
  local cur = redis.call('HMGET', key, unpack(fields))
  local args = {}
  for i, field in ipairs(fields) do
    args[#args + 1] = field
    args[#args + 1] = string.format('%d', int_of(cur[i], key, field) + delta[i])
  end
  for _, v in ipairs(extra or {}) do args[#args + 1] = v end
  redis.call('HSET', key, unpack(args))
end

local function book(key, amount, fcost, mode, u, model, extra)
  local fields, delta = {}, {}
  -- `always`: written even when the change is 0 (as HINCRBY by 0 would create the field).
  local function add(field, d, always)
    if always or d ~= 0 then
      fields[#fields + 1] = field
      delta[#delta + 1] = d
    end
  end
  add('reserved', -amount, true)
  add('open', -1, true)
  add('reserved_micro', -fcost)
  if mode == 'release' then
    add('releases', 1, true)
  else
    add('calls', 1, true)
    if mode == 'settle' then
      -- Zero usage of a kind is not written (a field per kind only once it is used).
      local total = u[1] + u[2] + u[3] + u[4]
      for i, field in ipairs(SETTLED) do add(field, u[i]) end
      add('spent', total, true)
      if total > amount then add('overrun', total - amount, true) end
      if model then
        for i, kind in ipairs(KINDS) do add('m:' .. model .. ':' .. kind, u[i]) end
      end
    else
      add('spent_unknown', amount, true)
      add('spent', amount, true)
      add('cost_micro_usd', fcost, true)
      add(mode == 'expire' and 'expired' or mode == 'unknown' and 'usage_unknown' or 'forfeits', 1, true)
      if model then
        add('m:' .. model .. ':unknown', amount, true)
        add('m:' .. model .. ':cost', fcost, true)
      end
    end
  end
  add_all(key, fields, delta, extra)
end

-- `member` is the reservation's entry in the expiry set: its id, then its record (kept in the
-- member itself, so opening and closing a reservation each touch one key less). A member that is a
-- bare id was written by a worker of an earlier version, which kept the record in the open hash.
-- `goal_extra`: field/value pairs written to the goal's books with the same HSET.
local function close(open_key, expiry_key, member, mode, u, goal_extra, watch)
  if redis.call('ZREM', expiry_key, member) == 0 then return false end
  local f = lines(member)
  if #f == 1 then
    local rec = redis.call('HGET', open_key, member)
    if not rec then return false end
    redis.call('HDEL', open_key, member)
    f = lines(member .. '\\n' .. rec)
  end
  local amount, fcost = tonumber(f[3]), tonumber(f[4])
  -- `watch` {field, value}: whether the goal's books held another value in that field before.
  local changed = watch and redis.call('HGET', f[2], watch[1]) ~= watch[2]
  book(f[2], amount, fcost, mode, u, nil, goal_extra)
  if f[6] ~= '-' then book(f[6], amount, fcost, mode, u, f[5]) end
  for i = 7, #f do book(f[i], amount, fcost, mode, u, nil) end
  if changed then return 2 end
  return 1
end

local function sweep(open_key, expiry_key, t, limit)
  local members = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', string.format('%.6f', t), 'LIMIT', 0, limit)
  for _, member in ipairs(members) do close(open_key, expiry_key, member, 'expire', nil) end
  return #members
end

-- UTC calendar date of epoch seconds `t` (H. Hinnant's civil_from_days; bus.tenants.period_label
-- is the same rule in Python).
local function civil(t)
  local z = math.floor(t / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function period_label(period, t)
  if period == 'day' then return string.format('%04d-%02d-%02d', civil(t)) end
  if period == 'month' then
    local y, m = civil(t)
    return string.format('%04d-%02d', y, m)
  end
  return 'all'
end
"""

# KEYS: goal books. ARGV: token budget, pool key prefix, dollar budget (micro-USD, 0 = none),
#       tenant ('' = none), then pool name/budget pairs.
# Creates the goal's books (and each pool's on first use) unless they exist. Returns 1 if created.
_OPEN = """
if redis.call('HSETNX', KEYS[1], 'budget', ARGV[1]) == 0 then return 0 end
local names = {}
for i = 5, #ARGV, 2 do
  redis.call('HSETNX', ARGV[2] .. ARGV[i], 'budget', ARGV[i + 1])
  names[#names + 1] = ARGV[i]
end
redis.call('HSET', KEYS[1], 'pools', table.concat(names, '\\n'), 'reserved', 0, 'spent', 0)
if ARGV[3] ~= '0' then redis.call('HSET', KEYS[1], 'budget_micro', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'tenant', ARGV[4]) end
return 1
"""

# KEYS: goal books, open hash, expiry zset.
# ARGV: reservation id, input estimate, max_tokens, min output, ttl, input and output price
#       (micro-USD per million tokens, the dearest input rate), pool key prefix, sweep batch,
#       model ('-' = none), priced (1/0), tenant key prefix.
# Returns {'ok', max_tokens, amount, expires_at, pools, worst cost, tenant pool name, spent permille,
#         expiry entry}
#       | {'missing'} | {'refused', pool name or '', unit, budget, spent, reserved, requested}
_RESERVE = (
    _LIB
    + """
local t = now()
local inp, maxt, minr = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local pin, pout, priced = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[11] == '1'
local function num(v) return tonumber(v or 0) or 0 end
local function limit(v) local x = num(v); if x > 0 then return x end return nil end

-- Most output tokens with ceil((inp * pin + out * pout) / 1e6) <= h (micro-USD of headroom), or
-- -1 when not even the input fits. Exact in doubles: past the first test, h * 1e6 is below the
-- call's worst case, a number of at most ~1e14.
local function usd_out(h)
  if h * 1000000 >= inp * pin + maxt * pout then return maxt end
  local rest = h * 1000000 - inp * pin
  if rest < 0 then return -1 end
  if pout == 0 then return maxt end
  local o = math.floor(rest / pout)
  while o > 0 and inp * pin + o * pout > h * 1000000 do o = o - 1 end
  return o
end

-- Reads the books this call draws from and decides how many output tokens it gets: returns the
-- goal's fields, the books, the tenant pool (key, name, new), the output tokens and the limiter
-- (books, unit), and the highest spent fraction; nil when the goal has no books.
local function decide()
  local g = redis.call('HMGET', KEYS[1], 'budget', 'spent', 'reserved', 'pools', 'tenant', 'budget_micro',
                       'cost_micro_usd', 'reserved_micro', 'open')
  if not g[1] then return nil end

  -- Every set of books this call draws from: tb/ub are the token and micro-USD budgets (nil = no
  -- limit of that unit), ts/us spent, tr/ur reserved.
  -- `raw` keeps the fields as read (reserved, open, reserved_micro), to write the new values back.
  local books = {}
  local function add(key, name, tb, ts, tr, ub, us, ur, raw)
    books[#books + 1] = {key = key, name = name, tb = tb, ts = ts, tr = tr, ub = ub, us = us, ur = ur, raw = raw}
  end
  add(KEYS[1], '', num(g[1]), num(g[2]), num(g[3]), limit(g[6]), num(g[7]), num(g[8]), {g[3], g[9], g[8]})
  for name in string.gmatch(g[4] or '', '[^\\n]+') do
    local key = ARGV[8] .. name
    local p = redis.call('HMGET', key, 'budget', 'spent', 'reserved', 'budget_micro', 'cost_micro_usd',
                         'reserved_micro', 'open')
    -- A missing pool has token budget 0: it refuses.
    add(key, name, num(p[1]), num(p[2]), num(p[3]), limit(p[4]), num(p[5]), num(p[6]), {p[3], p[7], p[6]})
  end
  -- The tenant's pool of the current period (UTC calendar); its limits are the tenant's settings
  -- as they are now, so lowering them takes effect at the next reservation.
  local tkey, tname, tnew = '-', '', false
  if g[5] then
    local c = redis.call('HMGET', ARGV[12] .. g[5], 'period', 'budget_tokens', 'budget_micro')
    tname = 'tenant:' .. g[5] .. ':' .. period_label(c[1], t)
    tkey = ARGV[8] .. tname
    local p = redis.call('HMGET', tkey, 'spent', 'reserved', 'cost_micro_usd', 'reserved_micro', 'budget', 'open')
    tnew = not p[5]
    add(tkey, tname, limit(c[2]), num(p[1]), num(p[2]), limit(c[3]), num(p[3]), num(p[4]), {p[2], p[6], p[4]})
  end

  -- The limiter is the books that leave the fewest output tokens; the goal wins ties, so a refusal
  -- names a pool only when the pool is tighter. clamp_output() in Python is the token rule.
  local out, lim, unit, frac = maxt, books[1], 'tokens', 0
  for _, b in ipairs(books) do
    if b.tb then
      if b.tb > 0 then frac = math.max(frac, b.ts / b.tb) end
      local o = math.min(maxt, b.tb - b.ts - b.tr - inp)
      if o < out then out, lim, unit = o, b, 'tokens' end
    end
    if b.ub then
      frac = math.max(frac, b.us / b.ub)
      local o = priced and usd_out(b.ub - b.us - b.ur) or -1
      if o < out then out, lim, unit = o, b, priced and 'usd' or 'unpriced' end
    end
  end
  return g, books, tkey, tname, tnew, out, lim, unit, frac
end

local g, books, tkey, tname, tnew, out, lim, unit, frac = decide()
if not g then return {'missing'} end
-- Expired reservations (their holders died) are forfeited only when they could matter: when this
-- call cannot have its full max_tokens. Then they are swept, and the call decided again. A call
-- with room to spare costs no sweep; `Ledger.sweep`, every snapshot and the supervisor's rounds
-- sweep too.
if out < maxt and sweep(KEYS[2], KEYS[3], t, tonumber(ARGV[9])) > 0 then
  g, books, tkey, tname, tnew, out, lim, unit, frac = decide()
end
local floor = math.max(1, math.min(maxt, minr))
if out < floor then
  redis.call('HINCRBY', KEYS[1], 'refusals', 1)
  if lim.name ~= '' then redis.call('HINCRBY', lim.key, 'refusals', 1) end
  if unit == 'tokens' then
    return {'refused', lim.name, unit, tostring(lim.tb), tostring(lim.ts), tostring(lim.tr), tostring(inp + floor)}
  end
  return {'refused', lim.name, unit, tostring(lim.ub), tostring(lim.us), tostring(lim.ur),
          tostring(math.ceil((inp * pin + floor * pout) / 1000000))}
end

local amount = inp + out
local fcost = math.ceil((inp * pin + out * pout) / 1000000)
-- One HSET per book from the values read above (HINCRBY per field cost a command each). A book
-- listed twice (a goal naming its tenant's pool as a pool too) is read afresh the second time.
local written = {}
for _, b in ipairs(books) do
  local fields, delta = {'reserved', 'open'}, {amount, 1}
  if fcost ~= 0 then fields[3], delta[3] = 'reserved_micro', fcost end
  if written[b.key] then
    add_all(b.key, fields, delta)
  else
    written[b.key] = true
    local args = {}
    for i, field in ipairs(fields) do
      args[#args + 1] = field
      args[#args + 1] = string.format('%d', int_of(b.raw[i], b.key, field) + delta[i])
    end
    if b.key == tkey and tnew then
      -- A new period's books: `budget` 0 marks them as existing (the limits live in the tenant's settings).
      args[#args + 1] = 'budget'
      args[#args + 1] = '0'
      args[#args + 1] = 'period_started'
      args[#args + 1] = string.format('%.3f', t)
    end
    redis.call('HSET', b.key, unpack(args))
  end
end
if tnew then
  redis.call('ZADD', ARGV[12] .. g[5] .. ':periods', string.format('%.6f', t), tname)
end
local rec = {ARGV[1], KEYS[1], tostring(amount), tostring(fcost), ARGV[10], tkey}
for _, b in ipairs(books) do
  if b.key ~= KEYS[1] and b.key ~= tkey then rec[#rec + 1] = b.key end
end
local expires = t + tonumber(ARGV[5])
local member = table.concat(rec, '\\n')
redis.call('ZADD', KEYS[3], string.format('%.6f', expires), member)
return {'ok', tostring(out), tostring(amount), string.format('%.6f', expires), g[4] or '', tostring(fcost), tname,
        tostring(math.floor(frac * 1000)), member}
"""
)

# KEYS: open hash, expiry zset.
# ARGV: reservation's expiry entry (`Reservation.entry`, or its id), mode ('settle' | 'release' | 'forfeit'
#       | 'unknown'), end the goal's provider trouble ('1'/'0': its clock `trouble_since` is set to 0 in
#       the same write as the goal's books, so a successful call ends it without a command of its own),
#       a field and value to write to the goal's books in that same write ('' '' for none: the model
#       that served a role, `served:<role>`), then for 'settle': input, output, cache read, cache
#       write tokens, cost, unpriced (0/1).
# Returns 1 if the reservation was open (and is now closed), 2 if so and the served model of the role
# changed (the first call of the role, or a failover), 0 if it was already closed.
_CLOSE = (
    _LIB
    + """
local u = {}
for i = 6, #ARGV do u[#u + 1] = tonumber(ARGV[i]) end
local extra, watch = {}, nil
if ARGV[3] == '1' then extra = {'trouble_since', '0'} end
if ARGV[4] ~= '' then
  extra[#extra + 1] = ARGV[4]; extra[#extra + 1] = ARGV[5]
  watch = {ARGV[4], ARGV[5]}
end
local closed = close(KEYS[1], KEYS[2], ARGV[1], ARGV[2], u, extra, watch)
if closed then return closed end
return 0
"""
)

# KEYS: open hash, expiry zset, [books to read]. ARGV: sweep batch.
# Forfeits expired reservations, then returns {number swept, field, value, ...} of KEYS[3].
_SWEEP = (
    _LIB
    + """
local out = {sweep(KEYS[1], KEYS[2], now(), tonumber(ARGV[1]))}
if KEYS[3] then
  for _, v in ipairs(redis.call('HGETALL', KEYS[3])) do out[#out + 1] = v end
end
return out
"""
)


# -- the ledger -----------------------------------------------------------------------------------


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: Sequence[Any]) -> dict[str, str]:
    it: Iterator[Any] = iter(flat)
    return {_s(k): _s(v) for k, v in zip(it, it, strict=True)}


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
        out = await self._reserve(
            keys=[self.keys.ledger(goal_id), self._open_key, self._expiry_key],
            args=[
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
        status = _s(out[0])
        if status == "missing":
            raise LedgerNotFound(goal_id)
        if status == "refused":
            pool, unit = _s(out[1]), _s(out[2])
            budget, spent, reserved, requested = (int(float(_s(v))) for v in out[3:7])
            raise BudgetExhausted(goal_id, budget, spent, reserved, requested, pool or None, unit)
        return Reservation(
            id=rid,
            goal_id=goal_id,
            input_tokens=estimated_input,
            max_tokens=int(_s(out[1])),
            amount=int(_s(out[2])),
            expires_at=float(_s(out[3])),
            pools=tuple(p for p in _s(out[4]).split("\n") if p),
            model=model,
            cost_micro=int(_s(out[5])),
            tenant_pool=_s(out[6]) or None,
            spent_fraction=int(_s(out[7])) / 1000,
            entry=_s(out[8]),
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
        out = await self._close(
            keys=[self._open_key, self._expiry_key],
            args=[reservation.entry or reservation.id, mode, int(end_trouble), field, value, *usage],
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
        return _pairs(out[1:])
