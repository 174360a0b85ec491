"""The expectations of a case, checked against one finished run: pure functions of what the run left.

Each failed condition is one sentence starting with the check's name (`contains`, `tool_args`,
`max_usd`, ...), so a report line says which check failed and by how much. The answer checks
(`pattern`, `json_schema`, `tools_called`) are the critic's own (`critic.checks.check_problems`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bus.schemas import GoalState
from critic.checks import check_problems

from .suite import Expect, ToolArgs


@dataclass(frozen=True)
class Called:
    """One tool call of the run: its name and the arguments the model gave (None: not stored)."""

    name: str
    input: dict[str, Any] | None


@dataclass(frozen=True)
class Observed:
    """What a run did, as the checks see it."""

    state: GoalState
    answer: str | None
    reason: str | None = None
    calls: Sequence[Called] = field(default_factory=tuple)
    cost_usd: float = 0.0
    seconds: float = 0.0
    steps: int = 0


def _arg_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _matches(call: Called, want: ToolArgs) -> bool:
    if call.name != want.tool or call.input is None:
        return False
    return all(name in call.input and re.search(p, _arg_text(call.input[name])) for name, p in want.args.items())


def tool_args_problem(calls: Sequence[Called], want: ToolArgs) -> str | None:
    if any(_matches(c, want) for c in calls):
        return None
    seen = [c.input for c in calls if c.name == want.tool]
    if not seen:
        return f"tool_args failed: {want.tool} was never called"
    shown = ", ".join(json.dumps(s, sort_keys=True) for s in seen[:3])
    return f"tool_args failed: no call of {want.tool} with arguments matching {json.dumps(want.args)} (got {shown})"


def problems(expect: Expect, run: Observed) -> list[str]:
    """Every condition of `expect` the run fails (empty: it passed)."""
    out: list[str] = []
    if run.state != expect.state:
        why = f" ({run.reason})" if run.reason else ""
        out.append(f"state failed: the goal ended {run.state.value}{why}, expected {expect.state.value}")
    answer = run.answer or ""
    check = expect.answer_check()
    if check is not None:
        out += check_problems(check, answer, {c.name for c in run.calls})
    for text in expect.contains:
        if text not in answer:
            out.append(f"contains failed: the answer does not contain {text!r}")
    for want in expect.tool_args:
        problem = tool_args_problem(run.calls, want)
        if problem is not None:
            out.append(problem)
    for name in expect.tools_not_called:
        n = sum(1 for c in run.calls if c.name == name)
        if n:
            out.append(f"tools_not_called failed: {name} was called {n} time{'s' if n > 1 else ''}")
    if expect.max_usd is not None and run.cost_usd > expect.max_usd:
        out.append(f"max_usd failed: cost ${run.cost_usd:.6f} > ${expect.max_usd:g}")
    if expect.max_seconds is not None and run.seconds > expect.max_seconds:
        out.append(f"max_seconds failed: took {run.seconds:.2f} s > {expect.max_seconds:g} s")
    if expect.max_steps is not None and run.steps > expect.max_steps:
        out.append(f"max_steps failed: {run.steps} model calls > {expect.max_steps}")
    return out
