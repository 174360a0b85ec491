"""The console report of an eval run: a table per case and model, the totals per model, and the
failures with their reasons. Text that models wrote is printed as text, never as markup."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..terminal import clean
from .results import CaseSummary, ModelSummary, Results


def pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


def usd(value: float) -> str:
    return f"${value:.4f}" if value < 1 else f"${value:.2f}"


def _rate_style(rate: float | None) -> str:
    if rate is None:
        return "yellow"
    return "green" if rate >= 1 else ("red" if rate == 0 else "yellow")


def case_table(cases: list[CaseSummary]) -> Table:
    table = Table(title="cases", title_justify="left")
    table.add_column("case", no_wrap=True)
    table.add_column("model", no_wrap=True)
    for name in ("pass", "tokens", "cost", "p50/p95 s", "steps", "retry", "replan"):
        table.add_column(name, justify="right", no_wrap=True)
    for c in cases:
        judged = c.runs - c.rerecord
        passed = Text(f"{c.passed}/{judged}", style=_rate_style(c.pass_rate))
        if c.rerecord:
            passed.append(f" +{c.rerecord} re-record", style="yellow")
        table.add_row(
            Text(c.case),
            Text(c.model),
            passed,
            f"{c.tokens:,}",
            usd(c.cost_usd),
            f"{c.p50_seconds:.1f}/{c.p95_seconds:.1f}",
            f"{c.steps:.1f}",
            str(c.retries),
            str(c.replans),
        )
    return table


def totals_table(totals: list[ModelSummary]) -> Table:
    table = Table(title="totals", title_justify="left")
    table.add_column("model", no_wrap=True)
    judged = any(t.judge_tokens for t in totals)
    names = ["pass rate", "spread", "runs", "tokens", "cost", "p50/p95 s", "retry", "replan"]
    for name in [*names, "judge cost"] if judged else names:
        table.add_column(name, justify="right", no_wrap=True)
    for t in totals:
        spread = f"{pct(t.spread[0])}-{pct(t.spread[1])}" if t.spread else "-"
        cells: list[Text | str] = [
            Text(t.model),
            Text(pct(t.pass_rate), style=_rate_style(t.pass_rate)),
            spread,
            str(t.runs),
            f"{t.tokens:,}",
            usd(t.cost_usd),
            f"{t.p50_seconds:.1f}/{t.p95_seconds:.1f}",
            str(t.retries),
            str(t.replans),
        ]
        if judged:
            cells.append(f"{usd(t.judge_cost_usd)} ({t.judge_tokens:,} tok)")
        table.add_row(*cells)
    return table


def failures(results: Results) -> Text:
    out = Text()
    for r in results.runs:
        if r.status == "passed":
            continue
        label = "needs re-recording" if r.status == "rerecord" else r.status
        style = "yellow" if r.status == "rerecord" else "red"
        out.append(f"{label} ", style=f"bold {style}")
        out.append(f"{r.case} [{r.model}] #{r.repeat}", style="bold")
        out.append(f" (goal {r.goal_id})\n" if r.goal_id else "\n")
        for problem in r.problems:
            out.append(f"  - {clean(problem)}\n")
        if r.diff:
            out.append("    " + clean(r.diff).replace("\n", "\n    ") + "\n", style="dim")
    return out


def render(results: Results) -> RenderableType:
    parts: list[RenderableType] = [case_table(results.cases), totals_table(results.totals)]
    if results.judge is not None:
        judged = Text(f"rubrics scored by {results.judge}")
        if results.judge == "demo" and any(m != "demo" for m in results.models):
            # The demo model accepts every answer: fine for the demo's own runs, no grade of a real model's.
            judged.append(" (the demo model accepts every answer: set `judge:` in the suite)", style="yellow")
        parts.append(judged)
    if any(r.status != "passed" for r in results.runs):
        parts.append(failures(results))
    return Group(*parts)


PIPE_WIDTH = 160  # columns when the output is no terminal (a CI log): no case id is cut


@contextlib.contextmanager
def wide(console: Console) -> Iterator[None]:
    """At least `PIPE_WIDTH` columns when the output is no terminal (rich assumes 80 there)."""
    if console.is_terminal or console.width >= PIPE_WIDTH:
        yield
        return
    before = console.width
    console.width = PIPE_WIDTH
    try:
        yield
    finally:
        console.width = before


def show(console: Console, results: Results) -> None:
    with wide(console):
        console.print(render(results), highlight=False)
