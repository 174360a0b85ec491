"""`taskloom eval`: score the whole fleet (plan, task attempts, critic verdicts, ledger) on a suite
of goals, per model, locally, on a remote fleet or from cassettes, and gate CI on the result.

- `suite`: the suite file (cases, expectations, tags), YAML or JSON.
- `checks`: the expectations, checked against a finished run (pure functions).
- `runner`: submit each case to a fleet, wait, read the run back, judge it.
- `judge`: a case's rubric scored by the judge model (LLM-as-judge), in ledger books of its own.
- `results`: the results file, the per-case and per-model summaries, the CI gate.
- `report`: the console tables. `compare`: what changed between two results files.
- `command`: the `taskloom eval` command's body (the CLI registers it).
"""

from .checks import Called, Observed, problems
from .command import EXIT_GATE, EXIT_RERECORD, Options, evaluate, verdict
from .compare import Change, changes
from .results import CaseSummary, ModelSummary, Results, RunRecord, gate, read_results
from .runner import Target
from .suite import Case, Expect, Suite, SuiteError, ToolArgs, load_suite, parse_suite

__all__ = [
    "EXIT_GATE",
    "EXIT_RERECORD",
    "Called",
    "Case",
    "CaseSummary",
    "Change",
    "Expect",
    "ModelSummary",
    "Observed",
    "Options",
    "Results",
    "RunRecord",
    "Suite",
    "SuiteError",
    "Target",
    "ToolArgs",
    "changes",
    "evaluate",
    "gate",
    "load_suite",
    "parse_suite",
    "problems",
    "read_results",
    "verdict",
]
