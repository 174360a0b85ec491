"""The suite file: the goals `taskloom eval` runs and what each one is expected to do.

YAML (`.yaml`/`.yml`) or JSON (any other name). YAML because a suite is written and reviewed by
people (multi-line goals, comments saying why a case exists); JSON for suites a program generates.
Both parse to the same models, so every field is checked the same way, with errors naming the
file, the case and the field.

```yaml
exclude_tags: [broken]          # left out unless asked for with --tag broken
judge: demo                     # the model that scores rubrics (default: TASKLOOM_MODEL)
defaults: {budget_tokens: 40000, timeout: 60}
cases:
  - id: refund-a100
    goal: "Can order A100 be refunded? Today is 2026-10-13."
    definition_of_done: "Says whether A100 can be refunded and why."
    allowed_tools: [lookup_order, refund_policy]
    tags: [refunds]
    expect:
      pattern: "A100: can be refunded"
      contains: ["30-day window"]
      tools_called: [lookup_order]
      tool_args: [{tool: lookup_order, args: {order_id: "^A100$"}}]
      tools_not_called: [issue_refund]
      max_usd: 0.05
      max_seconds: 20
      max_steps: 10
    rubric: "Names the refund window; promises no refund it cannot give."   # scored by the judge
```
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bus.schemas import Check, Goal, GoalState

CASE_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class SuiteError(ValueError):
    """The suite file cannot be read or is invalid; the message names the file and what is wrong."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolArgs(_Model):
    """The tool `tool` was called at least once with arguments matching `args`: each named argument's
    value (as JSON text when it is not a string) matches its regular expression (`re.search`)."""

    tool: str = Field(min_length=1)
    args: dict[str, str] = Field(default_factory=dict)

    @field_validator("args")
    @classmethod
    def _regexes(cls, v: dict[str, str]) -> dict[str, str]:
        for name, pattern in v.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"args.{name} is not a valid regular expression: {exc}") from None
        return v


class Expect(_Model):
    """What a run of the case must do to pass. Every condition given must hold."""

    state: GoalState = Field(default=GoalState.SUCCEEDED, description="how the goal must end")
    # The answer checks are the critic's own (`bus.schemas.Check`), so a suite and a goal's `check` agree.
    pattern: str | None = Field(default=None, description="regex the answer matches (re.search)")
    json_schema: dict[str, Any] | None = Field(default=None, description="JSON Schema the answer meets")
    tools_called: list[str] = Field(default_factory=list, description="tools called at least once")
    contains: list[str] = Field(default_factory=list, description="substrings the answer contains")
    tool_args: list[ToolArgs] = Field(default_factory=list, description="calls with matching arguments")
    tools_not_called: list[str] = Field(default_factory=list, description="tools never called")
    max_usd: float | None = Field(default=None, ge=0, description="most the run may cost")
    max_seconds: float | None = Field(default=None, gt=0, description="longest the goal may take")
    max_steps: int | None = Field(default=None, ge=1, description="most model calls, every role counted")

    @model_validator(mode="after")
    def _answer_check_valid(self) -> Expect:
        self.answer_check()  # a bad regex or schema is refused when the suite is read
        return self

    def answer_check(self) -> Check | None:
        """The `Check` of the answer conditions, or None when there are none."""
        if self.pattern is None and self.json_schema is None and not self.tools_called:
            return None
        return Check(pattern=self.pattern, json_schema=self.json_schema, tools_called=self.tools_called)


class Case(_Model):
    id: str = Field(pattern=CASE_ID)
    goal: str = Field(min_length=1, description="the goal's text")
    definition_of_done: str = ""
    allowed_tools: list[str] | None = None
    budget_tokens: int | None = Field(default=None, gt=0)
    budget_usd: float | None = Field(default=None, gt=0)
    timeout: float | None = Field(default=None, gt=0, description="seconds before the run counts as failed")
    tags: list[str] = Field(default_factory=list)
    expect: Expect = Field(default_factory=Expect)
    rubric: str | None = Field(default=None, max_length=10_000, description="what the judge model checks")

    @model_validator(mode="after")
    def _a_valid_goal(self) -> Case:
        self.to_goal(None, {})  # what the goal itself refuses (an empty tool name, ...) is refused on load
        return self

    def to_goal(self, model: str | None, labels: dict[str, str]) -> Goal:
        """The goal submitted for one run of the case (`model`: the alias it runs on, None: the fleet's)."""
        return Goal(
            text=self.goal,
            definition_of_done=self.definition_of_done,
            allowed_tools=self.allowed_tools,
            budget_tokens=self.budget_tokens,
            budget_usd=self.budget_usd,
            model=model,
            metadata=labels,
        )


class Defaults(_Model):
    budget_tokens: int | None = Field(default=None, gt=0)
    budget_usd: float | None = Field(default=None, gt=0)
    timeout: float = Field(default=60.0, gt=0)
    allowed_tools: list[str] | None = None


class Suite(_Model):
    name: str = ""
    judge: str | None = Field(default=None, min_length=1, description="model scoring rubrics (else TASKLOOM_MODEL)")
    defaults: Defaults = Field(default_factory=Defaults)
    exclude_tags: list[str] = Field(default_factory=list, description="left out unless selected with --tag")
    cases: list[Case] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> Suite:
        seen: set[str] = set()
        for case in self.cases:
            if case.id in seen:
                raise ValueError(f"case id {case.id!r} appears twice")
            seen.add(case.id)
        return self

    def resolved(self, case: Case) -> Case:
        """The case with the suite's defaults filled in where it sets nothing."""
        d = self.defaults
        return case.model_copy(
            update={
                "budget_tokens": case.budget_tokens or d.budget_tokens,
                "budget_usd": case.budget_usd or d.budget_usd,
                "timeout": case.timeout or d.timeout,
                "allowed_tools": case.allowed_tools if case.allowed_tools is not None else d.allowed_tools,
            }
        )

    def select(self, tags: list[str]) -> list[Case]:
        """The cases to run, defaults applied. `tags`: `T` keeps the cases tagged T (any of them),
        `!T` drops those tagged T. Without a positive tag, every case not tagged with one of the
        suite's `exclude_tags` runs; a tag asked for explicitly brings its cases back."""
        wanted = {t for t in tags if not t.startswith("!")}
        dropped = {t[1:] for t in tags if t.startswith("!")}
        excluded = set(self.exclude_tags) - wanted
        chosen = []
        for case in self.cases:
            have = set(case.tags)
            if wanted and not have & wanted:
                continue
            if have & (dropped | excluded):
                continue
            chosen.append(self.resolved(case))
        return chosen


def parse_suite(raw: object, source: str) -> Suite:
    try:
        return Suite.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            loc = list(err["loc"])
            if len(loc) >= 2 and loc[0] == "cases" and isinstance(loc[1], int) and isinstance(raw, dict):
                cases = raw.get("cases")
                if isinstance(cases, list) and loc[1] < len(cases) and isinstance(cases[loc[1]], dict):
                    loc[1] = f"[{cases[loc[1]].get('id', loc[1])}]"
            where = ".".join(str(p) for p in loc).replace(".[", "[")
            problems.append(f"{where + ': ' if where else ''}{str(err['msg']).removeprefix('Value error, ')}")
        raise SuiteError(f"{source}: " + "; ".join(problems)) from None


def load_suite(path: Path) -> Suite:
    """Read and check a suite file; `SuiteError` naming the file and every problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SuiteError(f"cannot read suite {path}: {exc.strerror or exc}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:  # pragma: no cover - pyyaml is a main dependency
            raise SuiteError(f"{path}: reading YAML needs pyyaml (pip install pyyaml), or write it as JSON") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SuiteError(f"{path}: invalid YAML: {exc}") from None
    else:
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise SuiteError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SuiteError(f"{path}: expected a mapping with a `cases` list at the top")
    return parse_suite(raw, str(path))
