"""`taskloom eval compare A.json B.json`: what changed from run A to run B, per case and model.

A case regresses when its pass rate fell (passed→failed); a cost or a p50 latency that grew by
more than `COST_WORSE` / `LATENCY_WORSE` is highlighted as a regression too (latency only when it
also grew by `LATENCY_FLOOR` seconds: a sub-second goal varies by more than 20% from run to run). Only a fallen pass
rate makes `compare` exit non-zero: cost and latency move with load and providers, and a CI that
wants a hard limit on them has `--max-usd` and each case's `max_seconds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .report import pct, usd, wide
from .results import CaseSummary, Results

COST_WORSE = 0.10  # +10% cost: highlighted
LATENCY_WORSE = 0.20  # +20% p50 latency: highlighted
LATENCY_FLOOR = 0.5  # ... and at least this many seconds more


@dataclass(frozen=True)
class Change:
    case: str
    model: str
    before: CaseSummary | None  # None: a case new in B
    after: CaseSummary | None  # None: a case gone from A

    @property
    def pass_change(self) -> str:
        if self.before is None:
            return f"new: {self.status(self.after)}"
        if self.after is None:
            return f"removed (was {self.status(self.before)})"
        a, b = self.status(self.before), self.status(self.after)
        return a if a == b else f"{a}→{b}"

    @staticmethod
    def status(s: CaseSummary | None) -> str:
        if s is None or s.pass_rate is None:
            return "not judged"
        if s.pass_rate == 1:
            return "passed"
        if s.pass_rate == 0:
            return "failed"
        return f"{pct(s.pass_rate)} passed"

    @property
    def cost_change(self) -> float | None:
        return _relative(self.before.cost_usd if self.before else None, self.after.cost_usd if self.after else None)

    @property
    def latency_change(self) -> float | None:
        """None when a side has no judged run (its latency is no measurement)."""
        b, a = self.before, self.after
        if b is None or a is None or b.pass_rate is None or a.pass_rate is None:
            return None
        return _relative(b.p50_seconds, a.p50_seconds)

    @property
    def worse_pass(self) -> bool:
        b, a = self.before, self.after
        return bool(b and a and b.pass_rate is not None and a.pass_rate is not None and a.pass_rate < b.pass_rate)

    @property
    def better_pass(self) -> bool:
        b, a = self.before, self.after
        return bool(b and a and b.pass_rate is not None and a.pass_rate is not None and a.pass_rate > b.pass_rate)

    @property
    def worse_cost(self) -> bool:
        c = self.cost_change
        return c is not None and c > COST_WORSE

    @property
    def worse_latency(self) -> bool:
        c = self.latency_change
        grew = (self.after.p50_seconds - self.before.p50_seconds) if self.after and self.before else 0.0
        return c is not None and c > LATENCY_WORSE and grew >= LATENCY_FLOOR

    @property
    def regressed(self) -> bool:
        return self.worse_pass or self.worse_cost or self.worse_latency


def _relative(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or before <= 0:
        return None
    return (after - before) / before


def changes(a: Results, b: Results) -> list[Change]:
    """One change per (case, model) of either run: A's order, then what only B has."""
    before = {(c.case, c.model): c for c in a.cases}
    after = {(c.case, c.model): c for c in b.cases}
    keys = list(dict.fromkeys([*before, *after]))
    return [Change(case, model, before.get((case, model)), after.get((case, model))) for case, model in keys]


def signed(change: float | None) -> str:
    return "-" if change is None else f"{change:+.0%}"


def as_json(items: list[Change]) -> list[dict[str, object]]:
    return [
        {
            "case": c.case,
            "model": c.model,
            "pass": c.pass_change,
            "pass_rate_before": c.before.pass_rate if c.before else None,
            "pass_rate_after": c.after.pass_rate if c.after else None,
            "cost_usd_before": c.before.cost_usd if c.before else None,
            "cost_usd_after": c.after.cost_usd if c.after else None,
            "cost_change": c.cost_change,
            "p50_seconds_before": c.before.p50_seconds if c.before else None,
            "p50_seconds_after": c.after.p50_seconds if c.after else None,
            "latency_change": c.latency_change,
            "regressed": c.regressed,
            "pass_regressed": c.worse_pass,
        }
        for c in items
    ]


def table(items: list[Change]) -> Table:
    t = Table(title="changes (A → B)", title_justify="left")
    for name in ("case", "model", "pass", "cost", "Δ cost", "p50 s", "Δ latency"):
        t.add_column(name, justify="left" if name in ("case", "model", "pass") else "right")
    for c in items:
        pass_style = "bold red" if c.worse_pass else ("green" if c.better_pass else "")
        cost = f"{usd(c.before.cost_usd) if c.before else '-'} → {usd(c.after.cost_usd) if c.after else '-'}"
        p50 = f"{c.before.p50_seconds:.2f}" if c.before else "-"
        p50 += f" → {c.after.p50_seconds:.2f}" if c.after else " → -"
        t.add_row(
            Text(("▼ " if c.regressed else "  ") + c.case, style="bold red" if c.regressed else ""),
            Text(c.model),
            Text(c.pass_change, style=pass_style),
            cost,
            Text(signed(c.cost_change), style="red" if c.worse_cost else ""),
            p50,
            Text(signed(c.latency_change), style="red" if c.worse_latency else ""),
        )
    return t


def show(console: Console, items: list[Change]) -> None:
    with wide(console):
        console.print(table(items), highlight=False)
    worse = [c for c in items if c.regressed]
    if worse:
        names = ", ".join(f"{c.case} [{c.model}]" for c in worse)
        console.print(Text(f"{len(worse)} regression(s): {names}", style="bold red"), soft_wrap=True)
    else:
        console.print(Text("no regressions", style="green"))
