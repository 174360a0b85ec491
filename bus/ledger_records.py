"""The ledger's records and errors: what callers hold and read (reservations, books, pools), how
the books' hashes and the reserve script's replies become them, and why a reservation is refused.

`bus.ledger` writes the books; this module only names and parses what it writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from .replies import as_str
from .store_errors import NotFound

# Pool names end up inside Redis keys and inside newline-separated records.
POOL_NAME_PATTERN = r"^[A-Za-z0-9_.:@-]{1,128}$"
# Tenant names too, and inside pool names (`tenant:<name>:<period>`): no colon.
TENANT_NAME_PATTERN = r"^[A-Za-z0-9_.@-]{1,64}$"


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


class Reservation(NamedTuple):
    """Tokens set aside for one model call; settle, release or forfeit it exactly once (repeats are no-ops).

    Made only from the reserve script's reply (`reservation_from_reply`, which checks its numbers): a
    plain immutable record, not a pydantic model, because every model call makes one and its
    validation was a fifth of the client's work in a held reserve+settle (bench/RESULTS.md). A named
    tuple rather than a frozen dataclass: made in 0.5 µs instead of 1.8 (a frozen dataclass sets each
    of its twelve fields through `object.__setattr__`). `_replace` makes a changed copy."""

    id: str
    goal_id: str
    input_tokens: int  # the input estimate reserved (>= 0)
    max_tokens: int  # output tokens reserved: the call's max_tokens, clamped (> 0)
    amount: int  # input_tokens + max_tokens
    expires_at: float  # Redis time (epoch seconds) after which it is forfeited
    pools: tuple[str, ...] = ()
    model: str | None = None
    cost_micro: int = 0  # worst-case micro-USD held (dearest rates), >= 0
    tenant_pool: str | None = None  # the tenant's period pool it draws from
    spent_fraction: float = 0.0  # the highest spent/budget among the books it draws from, before this call
    # Its entry in the expiry set (id, then the record of the books it holds, one a line): closing it
    # removes this entry, so the close script reads no record. "" for one whose record is in the open
    # hash (closed by `id`).
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
        # A tenant period pool keeps its settled tokens by kind per model only.
        kinds = {f"spent_{k}": v for k, v in (per_model_kinds(h) or {}).items()}

        def n(field: str) -> int:
            if field in kinds:
                return kinds[field]
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


SETTLED_KINDS = ("input", "output", "cache_read", "cache_write")


def per_model(h: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """The per-model fields of books that keep them (`m:<model>:<kind>`, a tenant's period pool):
    model -> kind -> value; empty for other books. The one reader of that layout."""
    per: dict[str, dict[str, int]] = {}
    for field, value in h.items():
        if field.startswith("m:"):
            model, _, kind = field[2:].rpartition(":")
            per.setdefault(model, {})[kind] = int(value)
    return per


def per_model_kinds(h: Mapping[str, str]) -> dict[str, int] | None:
    """The settled tokens by kind of books that keep them per model, summed over the models; None
    for books without per-model fields. Such books keep no totals by kind of their own (a settle
    writes four fields fewer); older workers wrote both, and the per-model fields alone still count
    every settle once."""
    per = per_model(h)
    if not per:
        return None
    return {kind: sum(kinds.get(kind, 0) for kinds in per.values()) for kind in SETTLED_KINDS}


def reservation_from_reply(
    out: Sequence[Any], rid: str, goal_id: str, estimated_input: int, model: str | None
) -> Reservation:
    """The reserve script's reply: the reservation made, or the error that says why none was."""
    status = out[0]
    if status != b"ok" and status != "ok":
        status = as_str(status)
        if status == "missing":
            raise LedgerNotFound(goal_id)
        if status == "refused":
            pool, unit = as_str(out[1]), as_str(out[2])
            budget, spent, reserved, requested = (int(float(as_str(v))) for v in out[3:7])
            raise BudgetExhausted(goal_id, budget, spent, reserved, requested, pool or None, unit)
        raise LedgerError(f"reserve reply for goal {goal_id!r} is {status!r}, not a reservation")
    # Checked here, though the script wrote it: the numbers are parsed straight from the reply's
    # items (hiredis gives integers as ints), and a reply that breaks the reservation's rules is an
    # error naming the item, not a record that misleads the settle.
    max_tokens, amount, cost_micro, permille = out[1], out[2], out[5], out[7]
    if type(max_tokens) is not int:
        max_tokens, amount, cost_micro, permille = int(max_tokens), int(amount), int(cost_micro), int(permille)
    if max_tokens <= 0 or amount != estimated_input + max_tokens or cost_micro < 0 or permille < 0:
        raise LedgerError(
            f"reserve reply for goal {goal_id!r} breaks the reservation's rules: max_tokens {max_tokens}, "
            f"amount {amount} (input {estimated_input}), cost_micro {cost_micro}, spent permille {permille}"
        )
    pools = as_str(out[4]) if out[4] else ""
    tenant_pool = as_str(out[6]) if out[6] else ""
    return Reservation(
        rid,
        goal_id,
        estimated_input,
        max_tokens,
        amount,
        float(out[3]),
        tuple(p for p in pools.split("\n") if p) if pools else (),
        model,
        cost_micro,
        tenant_pool or None,
        permille / 1000,
        as_str(out[8]),
    )
