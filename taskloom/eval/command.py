"""`taskloom eval`: run a suite, show and save the report, gate on it; and `taskloom eval compare`.

Exit codes: 0 the gate passed; 2 invalid suite, option, cassette or configuration; 3 the gate
failed (a model's pass rate below `--min-pass`, or the cost above `--max-usd`), naming each failing
case and check; 5 the gate passed on every judged run but some replayed case needs re-recording (its
prompt changed since the cassette was recorded), so the suite did not judge everything. `compare`
exits 3 when a case's pass rate fell from A to B.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from llm.cassette import CassetteError
from llm.port import ModelPort

from ..settings import Settings
from ..terminal import clean
from ..testing.replay import ReplayModel
from . import compare as comparing
from . import report
from .results import Results, ResultsError, RunRecord, gate, read_results, stale, summarize, write_results
from .runner import Target, new_run_id, order, run_local, run_remote
from .suite import Case, Suite, SuiteError, load_suite

EXIT_GATE = 3
EXIT_RERECORD = 5


@dataclass
class Options:
    suite: Path
    models: list[str] = field(default_factory=list)
    repeat: int = 1
    concurrency: int = 4
    local: bool = False
    min_pass: float = 1.0
    max_usd: float | None = None
    replay: Path | None = None
    tags: list[str] = field(default_factory=list)
    out: Path | None = None


def replay_targets(path: Path, names: Sequence[str | None], default: str) -> list[Target]:
    """One replayed model per name: a directory holds `<model>.jsonl` per model; a file serves every
    model. Raises `CassetteError` naming a cassette that does not exist."""
    targets = []
    for name in names:
        cassette = path / f"{name or default}.jsonl" if path.is_dir() else path
        targets.append(Target(name, ReplayModel(cassette), replay=True))
    return targets


def targets_for(options: Options, settings: Settings, ports: Mapping[str, ModelPort] | None) -> list[Target]:
    names: list[str | None] = list(dict.fromkeys(options.models)) or [None]
    if options.replay is not None:
        return replay_targets(options.replay, names, settings.model)
    ports = ports or {}
    return [Target(n, ports.get(n) if n is not None else None) for n in names]


@contextlib.contextmanager
def progress_bar(console: Console | None, total: int) -> Iterator[tuple[Progress | None, TaskID]]:
    """A progress bar on `console` when it is a terminal; nothing otherwise (pipes, CI logs, --json)."""
    if console is None or not console.is_terminal:
        yield None, TaskID(0)
        return
    bar = Progress(
        TextColumn("eval"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} not passed"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    with bar:
        yield bar, bar.add_task("eval", total=total, failed=0)


async def evaluate(
    settings: Settings,
    options: Options,
    *,
    suite: Suite | None = None,
    ports: Mapping[str, ModelPort] | None = None,
    progress: Console | None = None,
) -> tuple[Results, list[Case]]:
    """Run the suite and return its results (also written to `options.out`). `ports`: models by
    name that replace the configured ones in local fleets (e.g. a `ScriptedModel` in tests)."""
    suite = suite or load_suite(options.suite)
    cases = suite.select(options.tags)
    if not cases:
        raise ValueError(f"--tag {' '.join(options.tags)}: no case of {options.suite} is selected")
    targets = targets_for(options, settings, ports)
    local = options.local or options.replay is not None or any(t.port is not None for t in targets)
    models = [t.label(settings, local) for t in targets]
    run_id = new_run_id()
    started = datetime.now(UTC)
    judge = (suite.judge or settings.model) if any(c.rubric for c in cases) else None
    failed = 0
    with progress_bar(progress, len(cases) * options.repeat * len(targets)) as (bar, task):

        def on_run(record: RunRecord) -> None:
            nonlocal failed
            failed += record.status != "passed"
            if bar is not None:
                bar.update(task, advance=1, failed=failed)

        runner = run_local if local else run_remote
        records = await runner(
            settings,
            cases,
            targets,
            repeat=options.repeat,
            concurrency=options.concurrency,
            run_id=run_id,
            on_run=on_run,
            judge=judge,
        )
    records = order(records, cases, models)
    case_sums, totals = summarize(records, models)
    fleet: Literal["local", "remote", "replay"] = (
        "replay" if options.replay is not None else ("local" if local else "remote")
    )
    results = Results(
        suite=str(options.suite),
        started_at=started,
        finished_at=datetime.now(UTC),
        fleet=fleet,
        judge=judge,
        repeat=options.repeat,
        models=models,
        runs=records,
        cases=case_sums,
        totals=totals,
    )
    out = options.out or settings.home / "eval" / f"{started:%Y%m%dT%H%M%SZ}-{run_id}.json"
    write_results(results, out)
    options.out = out
    return results, cases


def verdict(results: Results, options: Options) -> tuple[int, list[str]]:
    """The exit code and the lines saying why it is not 0."""
    reasons = gate(results, options.min_pass, options.max_usd)
    if reasons:
        return EXIT_GATE, reasons
    rerecord = stale(results)
    if rerecord:
        return EXIT_RERECORD, [f"needs re-recording (prompt changed since the cassette): {', '.join(rerecord)}"]
    return 0, []


def print_outcome(console: Console, results: Results, options: Options, code: int, reasons: list[str]) -> None:
    report.show(console, results)
    console.print(f"results: {options.out}", highlight=False, soft_wrap=True)
    if code == 0:
        console.print("[green]eval passed[/green]")
    for reason in reasons:
        # Case ids and check messages are data: printed as text.
        head = "eval failed: " if code == EXIT_GATE else "eval incomplete: "
        console.print(Text(head, style="bold red") + Text(clean(reason)), soft_wrap=True)


def compare_files(a: Path, b: Path, as_json: bool, console: Console) -> int:
    """Print what changed from A to B; 3 when a pass rate fell."""
    items = comparing.changes(read_results(a), read_results(b))
    if as_json:
        sys.stdout.write(json.dumps({"changes": comparing.as_json(items)}) + "\n")
    else:
        comparing.show(console, items)
    return EXIT_GATE if any(c.worse_pass for c in items) else 0


# What `taskloom eval` reports as invalid input (exit 2, one line naming the file and the problem).
INVALID = (SuiteError, ResultsError, CassetteError)


async def main(settings: Settings, options: Options, as_json: bool, out: Console, err: Console) -> int:
    """The `taskloom eval SUITE` command: run, report (table or JSON), write the results file, gate."""
    from ..logs import configure_logging

    # A tool error or a spent budget is an outcome the report shows, not news for the log.
    configure_logging("ERROR", json=True, stream=sys.stderr)
    results, _ = await evaluate(settings, options, progress=None if as_json else err)
    code, reasons = verdict(results, options)
    if as_json:
        doc = {**results.model_dump(mode="json"), "results_file": str(options.out), "exit_code": code}
        doc["reasons"] = reasons
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    else:
        print_outcome(out, results, options, code, reasons)
    return code
