"""Model prices: USD per million tokens of each kind, and the ledger's integer arithmetic on them.

Where a price comes from, first match wins:
1. overrides: `TASKLOOM_PRICES` and the `prices` of an alias in the models file, by model id
   (an exact id, or the longest listed prefix of it, so `claude-sonnet-4-5` covers its dated ids);
2. `genai-prices`, the pydantic team's maintained price database (read from the installed package,
   never fetched at run time), for the models it knows: Claude, OpenAI, Gemini and many more;
3. the offline `demo` model, free.
A model none of these prices is *unpriced*: its calls still count against token budgets, but a
goal (or pool) with a dollar budget refuses to call it (the reserve script), as dollars cannot be
checked for it.

Tiered prices (a higher rate past some input size): a call's worst case is reserved at the tier
its input estimate reaches (the estimate errs high), and a settled call is priced at the tier its
real input reached.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llm.types import Usage


class ModelPrice(BaseModel):
    """USD per million tokens of each kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cache_read: float = Field(ge=0)
    cache_write: float = Field(ge=0)


# Prices no library knows. Everything else comes from genai-prices (see the module docstring).
DEFAULT_PRICES: Mapping[str, ModelPrice] = {
    "demo": ModelPrice(input=0, output=0, cache_read=0, cache_write=0),
}

# Integer micro-USD per million tokens: (input, output, cache read, cache write).
Rates = tuple[int, int, int, int]
# A rate table: the base rates, then (input tokens from which it applies, rates) per higher tier.
Tiers = tuple[Rates, tuple[tuple[int, Rates], ...]]

# Claude ids as Bedrock and Vertex spell them, reduced to the Anthropic id genai-prices knows:
# `us.anthropic.claude-sonnet-4-5-20250929-v1:0` and `claude-sonnet-4-5@20250929`.
_BEDROCK = re.compile(r"^(?:[a-z]{2,6}\.)?anthropic\.(?P<id>claude-[A-Za-z0-9.-]+?)(?:-v\d+(?::\d+)?)?$")
_VERTEX = re.compile(r"^(?P<id>claude-[A-Za-z0-9.-]+)@(?P<date>\d{8})$")


def usd_to_micro(usd: float) -> int:
    """Dollars as integer micro-USD (rounded down: a budget never grows by rounding)."""
    return int(Decimal(str(usd)) * 1_000_000)


def _rate(usd_per_mtok: float | Decimal) -> int:
    """USD per million tokens as integer micro-USD per million tokens (rounded up, exact for prices
    with up to 6 decimals), so costs are exact integer arithmetic here and in the reserve script."""
    return math.ceil(Decimal(str(usd_per_mtok)) * 1_000_000)


def canonical_model_id(model: str) -> str:
    """The id a price database files `model` under (Bedrock and Vertex spell Claude ids their way)."""
    if m := _BEDROCK.match(model):
        return m.group("id")
    if m := _VERTEX.match(model):
        return f"{m.group('id')}-{m.group('date')}"
    return model


def _tiers_of(value: Any) -> tuple[int, list[tuple[int, int]]]:
    """(base rate, [(start, rate)...]) of a genai-prices price: a number, None or a TieredPrices."""
    if value is None:
        return 0, []
    base = getattr(value, "base", None)
    if base is None:
        return _rate(value), []
    return _rate(base), [(int(t.start), _rate(t.price)) for t in getattr(value, "tiers", [])]


def library_tiers(model: str) -> Tiers | None:
    """The rates genai-prices lists for `model`, or None when it does not know it."""
    try:
        from genai_prices import Usage as LibUsage
        from genai_prices import calc_price
    except ImportError:  # pragma: no cover - a dependency; only its absence would bring us here
        return None
    try:
        price = calc_price(LibUsage(input_tokens=0, output_tokens=0), model_ref=canonical_model_id(model)).model_price
    except Exception:  # LookupError for unknown ids; anything else is equally "no price"
        return None
    kinds = [_tiers_of(getattr(price, f)) for f in ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")]
    if kinds[3] == (0, []):  # no cache-write price listed (OpenAI): cache writes are not billed apart
        kinds[3] = (kinds[0][0], list(kinds[0][1]))
    base: Rates = (kinds[0][0], kinds[1][0], kinds[2][0], kinds[3][0])
    starts = sorted({start for _, tiers in kinds for start, _ in tiers})
    tiers = []
    for start in starts:
        rates = tuple(max([rate for s, rate in tiers_ if s <= start], default=b) for b, tiers_ in kinds)
        tiers.append((start, (rates[0], rates[1], rates[2], rates[3])))
    return base, tuple(tiers)


class PriceTable:
    """Per-model prices; costs are integer micro-USD, rounded up (the books never under-report).

    `prices` override everything else; `library=False` leaves genai-prices out (tests that need a
    closed table)."""

    def __init__(
        self, prices: Mapping[str, ModelPrice] | None = None, *, defaults: bool = True, library: bool | None = None
    ) -> None:
        merged = dict(DEFAULT_PRICES) if defaults else {}
        merged.update(prices or {})
        # Longest prefix first, so "claude-opus-4-5" wins over "claude-opus-4".
        self._prices = sorted(merged.items(), key=lambda kv: len(kv[0]), reverse=True)
        self._library = defaults if library is None else library
        # model id -> its tiers, or None: resolved once per id.
        self._tiers: dict[str, Tiers | None] = {}

    def price(self, model: str | None) -> ModelPrice | None:
        """The price listed for `model` (base tier), wherever it comes from."""
        tiers = self._tiers_of(model)
        if tiers is None:
            return None
        per_mtok = [Decimal(r) / 1_000_000 for r in tiers[0]]
        return ModelPrice(
            input=float(per_mtok[0]), output=float(per_mtok[1]), cache_read=float(per_mtok[2]),
            cache_write=float(per_mtok[3]),
        )

    def source(self, model: str | None) -> str | None:
        """Where `model`'s price comes from: 'configured', 'genai-prices', or None (unpriced)."""
        if model is None:
            return None
        if self._listed(model) is not None:
            return "configured"
        return "genai-prices" if self._tiers_of(model) is not None else None

    def _listed(self, model: str) -> ModelPrice | None:
        return next((p for name, p in self._prices if model == name or model.startswith(name)), None)

    def _tiers_of(self, model: str | None) -> Tiers | None:
        if model is None:
            return None
        if model not in self._tiers:
            p = self._listed(model)
            if p is not None:
                self._tiers[model] = ((_rate(p.input), _rate(p.output), _rate(p.cache_read), _rate(p.cache_write)), ())
            else:
                self._tiers[model] = library_tiers(model) if self._library else None
        return self._tiers[model]

    def cost(self, model: str | None, usage: Usage) -> int | None:
        """Micro-USD of `usage` on `model`; None when the model has no price."""
        tiers = self._tiers_of(model)
        if tiers is None:
            return None
        prompt = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
        r = tiers[0]
        for start, rates in tiers[1]:
            if prompt > start:
                r = rates
        scaled = (
            usage.input_tokens * r[0]
            + usage.output_tokens * r[1]
            + usage.cache_read_tokens * r[2]
            + usage.cache_write_tokens * r[3]
        )
        return -(-scaled // 1_000_000)  # ceiling division

    def per_mtok_micro(self, model: str | None, input_tokens: int | None = None) -> tuple[int, int]:
        """(input, output) price in micro-USD per million tokens, for the reserve script: the
        reservation's worst case. Input is priced at the dearest rate an input token can incur
        (the cache-write rate when it is above the input rate), output at the output rate, both
        of the tier a prompt of `input_tokens` reaches (None: the highest tier). The input
        estimate errs high, so the tier it picks is never below the call's real one."""
        tiers = self._tiers_of(model)
        if tiers is None:
            return (0, 0)
        if not tiers[1]:  # one tier, the common case: no list built per call
            r = tiers[0]
            return max(r[0], r[2], r[3]), r[1]
        every = [tiers[0], *(rates for start, rates in tiers[1] if input_tokens is None or input_tokens > start)]
        return max(max(r[0], r[2], r[3]) for r in every), max(r[1] for r in every)

    def priced(self, model: str | None) -> bool:
        return self._tiers_of(model) is not None
