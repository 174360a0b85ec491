"""The results file of an eval run, and the numbers drawn from it: per case, per model, and the CI gate.

One JSON file per run (`--out`, default `.taskloom/eval/<started>.json`): every run of every case
(`RunRecord`), and the summaries computed from them, so that `compare` and any other program read
the same numbers the table showed. Everything here is a pure function of the run records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FORMAT = "taskloom-eval/1"
Status = Literal["passed", "failed", "error", "rerecord"]
# passed: every expectation held. failed: some did not (`problems` says which). error: the run did
# not finish (timed out, workers stopped). rerecord: a replayed request was not in the cassette: the
# prompt changed, the cassette needs re-recording; the agent is not judged.


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunRecord(_Model):
    """One run of one case on one model."""

    case: str
    model: str
    repeat: int = Field(ge=1)
    goal_id: str | None = None
    status: Status
    problems: list[str] = Field(default_factory=list)
    state: str | None = None
    answer: str | None = None
    tokens: int = 0
    cost_usd: float = 0.0
    seconds: float = 0.0
    steps: int = 0
    tool_calls: int = 0
    retries: int = 0
    replans: int = 0
    diff: str | None = Field(default=None, description="why a replayed request missed its cassette")
    rubric_passed: bool | None = Field(default=None, description="the judge's verdict (None: no rubric or unscored)")
    rubric_feedback: str | None = None
    judge_tokens: int = 0
    judge_cost_usd: float = 0.0


class CaseSummary(_Model):
    case: str
    model: str
    runs: int
    passed: int
    rerecord: int
    pass_rate: float | None = Field(description="passed / judged runs (None: none was judged)")
    tokens: int
    cost_usd: float
    p50_seconds: float
    p95_seconds: float
    steps: float = Field(description="mean model calls per run")
    retries: int
    replans: int
    judge_cost_usd: float = 0.0
    failures: list[str] = Field(default_factory=list, description="each distinct reason, once")


class ModelSummary(_Model):
    model: str
    runs: int
    passed: int
    rerecord: int
    pass_rate: float | None
    spread: tuple[float, float] | None = Field(description="lowest and highest pass rate of one repeat round")
    tokens: int
    cost_usd: float
    p50_seconds: float
    p95_seconds: float
    steps: float
    retries: int
    replans: int
    judge_tokens: int = 0
    judge_cost_usd: float = 0.0


class Results(_Model):
    format: str = FORMAT
    suite: str
    started_at: datetime
    finished_at: datetime
    fleet: Literal["local", "remote", "replay"]
    judge: str | None = Field(default=None, description="the model that scored rubrics (None: no rubric ran)")
    repeat: int
    models: list[str]
    runs: list[RunRecord]
    cases: list[CaseSummary]
    totals: list[ModelSummary]


class ResultsError(ValueError):
    """A results file cannot be read; the message names the file."""


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (0 for no values): p50 and p95 of a handful of runs stay real runs."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _rate(passed: int, judged: int) -> float | None:
    return passed / judged if judged else None


def summarize_case(runs: Sequence[RunRecord]) -> CaseSummary:
    first = runs[0]
    judged = [r for r in runs if r.status != "rerecord"]
    passed = sum(1 for r in judged if r.status == "passed")
    seconds = [r.seconds for r in judged]
    failures = list(dict.fromkeys(p for r in runs if r.status != "passed" for p in r.problems))
    return CaseSummary(
        case=first.case,
        model=first.model,
        runs=len(runs),
        passed=passed,
        rerecord=len(runs) - len(judged),
        pass_rate=_rate(passed, len(judged)),
        tokens=sum(r.tokens for r in runs),
        cost_usd=sum(r.cost_usd for r in runs),
        p50_seconds=percentile(seconds, 50),
        p95_seconds=percentile(seconds, 95),
        steps=sum(r.steps for r in judged) / len(judged) if judged else 0.0,
        retries=sum(r.retries for r in runs),
        replans=sum(r.replans for r in runs),
        judge_cost_usd=sum(r.judge_cost_usd for r in runs),
        failures=failures,
    )


def summarize_model(model: str, runs: Sequence[RunRecord]) -> ModelSummary:
    judged = [r for r in runs if r.status != "rerecord"]
    passed = sum(1 for r in judged if r.status == "passed")
    rounds = sorted({r.repeat for r in judged})
    rates = []
    for n in rounds:
        round_runs = [r for r in judged if r.repeat == n]
        rates.append(sum(1 for r in round_runs if r.status == "passed") / len(round_runs))
    seconds = [r.seconds for r in judged]
    return ModelSummary(
        model=model,
        runs=len(runs),
        passed=passed,
        rerecord=len(runs) - len(judged),
        pass_rate=_rate(passed, len(judged)),
        spread=(min(rates), max(rates)) if rates else None,
        tokens=sum(r.tokens for r in runs),
        cost_usd=sum(r.cost_usd for r in runs),
        p50_seconds=percentile(seconds, 50),
        p95_seconds=percentile(seconds, 95),
        steps=sum(r.steps for r in judged) / len(judged) if judged else 0.0,
        retries=sum(r.retries for r in runs),
        replans=sum(r.replans for r in runs),
        judge_tokens=sum(r.judge_tokens for r in runs),
        judge_cost_usd=sum(r.judge_cost_usd for r in runs),
    )


def summarize(runs: Iterable[RunRecord], models: Sequence[str]) -> tuple[list[CaseSummary], list[ModelSummary]]:
    """Per (case, model) in the suite's case order, and per model in the order given."""
    runs = list(runs)
    keys = list(dict.fromkeys((r.case, r.model) for r in runs))
    cases = [summarize_case([r for r in runs if (r.case, r.model) == key]) for key in keys]
    totals = [summarize_model(m, [r for r in runs if r.model == m]) for m in models]
    return cases, totals


def gate(results: Results, min_pass: float, max_usd: float | None) -> list[str]:
    """Why the run fails the CI gate (empty: it passes): a model whose pass rate is below `min_pass`,
    naming each failing case and check, or the whole run's cost (the agents' and the judge's) above
    `max_usd`."""
    reasons = []
    for total in results.totals:
        if total.pass_rate is not None and total.pass_rate < min_pass:
            failing = [
                f"{r.case}#{r.repeat}: {r.problems[0] if r.problems else r.status}"
                for r in results.runs
                if r.model == total.model and r.status in ("failed", "error")
            ]
            reasons.append(
                f"model {total.model}: pass rate {total.pass_rate:.0%} ({total.passed}/{total.runs - total.rerecord}) "
                f"below --min-pass {min_pass:.0%}; " + "; ".join(failing)
            )
    cost = sum(t.cost_usd + t.judge_cost_usd for t in results.totals)
    if max_usd is not None and cost > max_usd:
        reasons.append(f"cost ${cost:.4f} above --max-usd ${max_usd:g}")
    return reasons


def stale(results: Results) -> list[str]:
    """The cases a replay could not answer (`case [model]`), each once."""
    return list(dict.fromkeys(f"{r.case} [{r.model}]" for r in results.runs if r.status == "rerecord"))


def read_results(path: Path) -> Results:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ResultsError(f"cannot read results {path}: {exc.strerror or exc}") from None
    try:
        results = Results.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ResultsError(f"{path}: not a taskloom eval results file ({where}: {first['msg']})") from None
    if results.format != FORMAT:
        raise ResultsError(f"{path}: results format {results.format!r}, expected {FORMAT!r}")
    return results


def write_results(results: Results, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(results.model_dump_json(indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
