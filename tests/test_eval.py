"""`taskloom eval`: the suite file, each check kind, the summaries and the CI gate, compare, and runs
on real workers (in this process and as the `taskloom` executable), with two models and from cassettes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from arq.connections import ArqRedis
from helpers import eventually, run_cli

from bus.connection import connect
from bus.keys import ROLES, Keys
from bus.ledger import Ledger, LedgerNotFound
from bus.schemas import GoalState
from llm.cassette import RecordingModel
from llm.demo import DemoModel
from llm.types import ModelRequest, ModelResponse, TextBlock, Usage
from taskloom import health
from taskloom.eval import (
    EXIT_GATE,
    EXIT_RERECORD,
    Called,
    Expect,
    Observed,
    Options,
    Results,
    RunRecord,
    SuiteError,
    changes,
    evaluate,
    gate,
    load_suite,
    parse_suite,
    problems,
    read_results,
    verdict,
)
from taskloom.eval.judge import Judge, JudgeReplyError
from taskloom.eval.judge import parse as parse_judgement
from taskloom.eval.results import ResultsError, percentile, summarize
from taskloom.settings import Settings, keys_for
from taskloom.testing import ScriptedModel
from taskloom.workers import run_workers

ROOT = Path(__file__).resolve().parent.parent
DEMO_SUITE = ROOT / "examples" / "demo-suite.yaml"

# -- the checks: one row per kind, passing and failing -------------------------------------------

RUN = Observed(
    state=GoalState.SUCCEEDED,
    answer='Order A100: can be refunded: within the 30-day window. {"x": 1}',
    calls=(Called("lookup_order", {"order_id": "A100"}), Called("refund_policy", {})),
    cost_usd=0.002,
    seconds=1.5,
    steps=10,
)
JSON_RUN = Observed(state=GoalState.SUCCEEDED, answer='{"order": "A100", "refundable": true}')

CHECKS: list[tuple[str, dict[str, Any], Observed, str | None]] = [
    ("state ok", {}, RUN, None),
    ("state", {"state": "failed"}, RUN, "state failed: the goal ended succeeded, expected failed"),
    ("pattern ok", {"pattern": r"A100: can be"}, RUN, None),
    ("pattern", {"pattern": r"cannot"}, RUN, "check pattern failed"),
    ("json_schema ok", {"json_schema": {"type": "object", "required": ["order"]}}, JSON_RUN, None),
    ("json_schema", {"json_schema": {"type": "object", "required": ["why"]}}, JSON_RUN, "check json_schema failed"),
    ("json_schema not json", {"json_schema": {"type": "object"}}, RUN, "the answer is not JSON"),
    ("tools_called ok", {"tools_called": ["lookup_order"]}, RUN, None),
    ("tools_called", {"tools_called": ["issue_refund"]}, RUN, "check tools_called failed: issue_refund not called"),
    ("contains ok", {"contains": ["30-day window"]}, RUN, None),
    ("contains", {"contains": ["60-day"]}, RUN, "contains failed: the answer does not contain '60-day'"),
    ("tool_args ok", {"tool_args": [{"tool": "lookup_order", "args": {"order_id": "^A100$"}}]}, RUN, None),
    (
        "tool_args mismatch",
        {"tool_args": [{"tool": "lookup_order", "args": {"order_id": "^A101$"}}]},
        RUN,
        'tool_args failed: no call of lookup_order with arguments matching {"order_id": "^A101$"} '
        '(got {"order_id": "A100"})',
    ),
    ("tool_args never", {"tool_args": [{"tool": "issue_refund"}]}, RUN, "tool_args failed: issue_refund was never"),
    ("tools_not_called ok", {"tools_not_called": ["issue_refund"]}, RUN, None),
    ("tools_not_called", {"tools_not_called": ["lookup_order"]}, RUN, "tools_not_called failed: lookup_order was"),
    ("max_usd ok", {"max_usd": 0.01}, RUN, None),
    ("max_usd", {"max_usd": 0.001}, RUN, "max_usd failed: cost $0.002000 > $0.001"),
    ("max_seconds ok", {"max_seconds": 2}, RUN, None),
    ("max_seconds", {"max_seconds": 1}, RUN, "max_seconds failed: took 1.50 s > 1 s"),
    ("max_steps ok", {"max_steps": 10}, RUN, None),
    ("max_steps", {"max_steps": 9}, RUN, "max_steps failed: 10 model calls > 9"),
]


@pytest.mark.parametrize(("kind", "expect", "run", "failure"), CHECKS, ids=[c[0] for c in CHECKS])
def test_each_check_kind(kind: str, expect: dict[str, Any], run: Observed, failure: str | None) -> None:
    """Each check kind passes when its condition holds and otherwise fails with a line naming the check."""
    found = problems(Expect.model_validate(expect), run)
    if failure is None:
        assert found == []
    else:
        assert len(found) == 1 and failure in found[0], found


def test_tool_args_match_non_string_arguments_as_json() -> None:
    """An argument that is not a string is matched as its JSON text (a number, a list)."""
    run = Observed(state=GoalState.SUCCEEDED, answer="", calls=(Called("pay", {"amount": 12.5, "ids": [1, 2]}),))
    ok = Expect.model_validate({"tool_args": [{"tool": "pay", "args": {"amount": r"^12\.5$", "ids": r"\[1, 2\]"}}]})
    assert problems(ok, run) == []


# -- the judge -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "verdict_"),
    [
        ('{"passed": true, "action": "accept", "feedback": "fine"}', (True, "fine")),
        ('Here it is: {"passed": false, "feedback": "vague"} done', (False, "vague")),
        ("I think it passes", "no JSON object"),
        ('{"passed": "yes"}', "no boolean `passed`"),
        ("{not json}", "not JSON"),
    ],
)
def test_judge_reply_parsing(reply: str, verdict_: tuple[bool, str] | str) -> None:
    """A judge's verdict is read from the JSON object in its reply; anything else is refused, saying why."""
    if isinstance(verdict_, tuple):
        assert parse_judgement(reply) == verdict_
    else:
        with pytest.raises(JudgeReplyError, match=verdict_):
            parse_judgement(reply)


class StrictJudge:
    """A model at the port boundary that fails every answer, as a strict judge would."""

    name = model = "strict-judge"

    async def complete(self, request: ModelRequest) -> ModelResponse:
        text = '{"passed": false, "action": "retry", "feedback": "does not cite the policy"}'
        usage = Usage(input_tokens=100, output_tokens=20)
        return ModelResponse(content=[TextBlock(text=text)], stop_reason="stop", usage=usage, model=self.model)


async def test_rubric_scored_through_its_own_books_in_the_ledger(redis: ArqRedis, keys: Keys) -> None:
    """The judge's call is metered in books of its own (judge-<goal id>), never the goal's."""
    judge = Judge(StrictJudge(), Ledger(redis, keys))
    judged = await judge.score("g1", "Can A100 be refunded?", "Cites the policy.", "Yes.")
    assert (judged.passed, judged.feedback, judged.tokens) == (False, "does not cite the policy", 120)
    assert (await Ledger(redis, keys).snapshot("judge-g1")).calls == 1
    with pytest.raises(LedgerNotFound):
        await Ledger(redis, keys).snapshot("g1")


# -- the suite file -------------------------------------------------------------------------------


def test_demo_suite_has_ten_cases_and_broken_ones_excluded_by_default() -> None:
    """The bundled suite has 10+ cases; those tagged `broken` run only when asked for."""
    suite = load_suite(DEMO_SUITE)
    default = [c.id for c in suite.select([])]
    broken = [c.id for c in suite.select(["broken"])]
    assert len(default) >= 10 and not any(i.startswith("broken") for i in default)
    assert broken and all(i.startswith("broken") for i in broken)
    assert "policy-question" not in [c.id for c in suite.select(["!policy"])]
    assert all(c.timeout == 30 and c.budget_tokens for c in suite.select([]))  # the defaults applied


def test_suite_errors_name_the_file_case_and_field(tmp_path: Path) -> None:
    """A bad case is refused with the file, the case id and the field; a bad regex is caught on load."""
    raw = {"cases": [{"id": "ok", "goal": "x"}, {"id": "bad", "goal": "x", "expect": {"max_steps": 0}}]}
    with pytest.raises(SuiteError, match=r"s\.json: cases\[bad\]\.expect\.max_steps: .*greater than or equal to 1"):
        parse_suite(raw, "s.json")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"cases": [{"id": "a", "goal": "x", "expect": {"pattern": "("}}]}))
    with pytest.raises(SuiteError, match="pattern is not a valid regular expression"):
        load_suite(path)
    dup = {"cases": [{"id": "a", "goal": "x"}, {"id": "a", "goal": "y"}]}
    with pytest.raises(SuiteError, match="case id 'a' appears twice"):
        parse_suite(dup, "d.json")
    (tmp_path / "s.json").write_text('{"cases": [{"id": "a", "goal": "x", "expekt": {}}]}')
    with pytest.raises(SuiteError, match=r"cases\[a\]\.expekt: Extra inputs are not permitted"):
        load_suite(tmp_path / "s.json")
    with pytest.raises(SuiteError, match=r"cannot read suite .*nope\.yaml"):
        load_suite(tmp_path / "nope.yaml")


# -- summaries, the gate, compare -----------------------------------------------------------------


def rec(case: str, status: str, repeat: int = 1, model: str = "demo", **kw: Any) -> RunRecord:
    problems_ = kw.pop("problems", ["contains failed: x"] if status == "failed" else [])
    return RunRecord(case=case, model=model, repeat=repeat, status=status, problems=problems_, **kw)  # type: ignore[arg-type]


def results_of(runs: list[RunRecord], models: list[str] | None = None) -> Results:
    models = models or list(dict.fromkeys(r.model for r in runs))
    cases, totals = summarize(runs, models)
    now = datetime.now(UTC)
    return Results(
        suite="s.yaml", started_at=now, finished_at=now, fleet="local", repeat=1, models=models,
        runs=runs, cases=cases, totals=totals,
    )


def test_pass_rate_spread_and_percentiles_over_repeats() -> None:
    """The pass rate counts judged runs; its spread is the lowest and highest rate of one repeat round."""
    runs = [
        rec("a", "passed", 1, seconds=1.0), rec("b", "passed", 1, seconds=2.0),
        rec("a", "failed", 2, seconds=3.0), rec("b", "passed", 2, seconds=4.0),
        rec("a", "rerecord", 3), rec("b", "passed", 3, seconds=5.0),
    ]
    r = results_of(runs)
    total = r.totals[0]
    assert (total.passed, total.rerecord, total.pass_rate) == (4, 1, 0.8)
    assert total.spread == (0.5, 1.0)
    a = next(c for c in r.cases if c.case == "a")
    assert (a.pass_rate, a.rerecord, a.failures) == (0.5, 1, ["contains failed: x"])
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0 and percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == 5.0


def test_gate_names_the_failing_case_and_check_and_the_cost() -> None:
    """The gate fails below --min-pass naming each failing case and check, and above --max-usd."""
    r = results_of([rec("a", "passed", cost_usd=0.5), rec("b", "failed", cost_usd=0.7)])
    assert gate(r, 0.5, None) == []
    [reason] = gate(r, 1.0, None)
    assert "model demo: pass rate 50% (1/2) below --min-pass 100%" in reason and "b#1: contains failed: x" in reason
    assert gate(r, 0.5, 1.0) == ["cost $1.2000 above --max-usd $1"]


def test_stale_cassettes_do_not_count_as_failures_but_exit_5() -> None:
    """A case needing re-recording is not judged (the gate passes) yet the run exits 5 naming it."""
    r = results_of([rec("a", "passed"), rec("b", "rerecord")])
    code, reasons = verdict(r, Options(Path("s.yaml")))
    assert code == EXIT_RERECORD and "b [demo]" in reasons[0]


def test_compare_reports_pass_cost_and_latency_changes() -> None:
    """compare shows passed→failed, cost and latency changes in percent, and flags regressions."""
    a = results_of([
        rec("a", "passed", cost_usd=0.10, seconds=1.0), rec("b", "failed", cost_usd=0.10, seconds=1.0),
        rec("d", "passed", cost_usd=0.10, seconds=0.4), rec("e", "passed", seconds=1.0),
    ])
    b = results_of([
        rec("a", "failed", cost_usd=0.15, seconds=1.5), rec("b", "passed", cost_usd=0.10, seconds=1.0),
        rec("c", "passed"), rec("d", "passed", cost_usd=0.105, seconds=0.6), rec("e", "rerecord"),
    ])
    by = {c.case: c for c in changes(a, b)}
    assert by["a"].pass_change == "passed→failed" and by["a"].worse_pass and by["a"].regressed
    assert round(by["a"].cost_change or 0, 2) == 0.5 and round(by["a"].latency_change or 0, 2) == 0.5
    assert by["a"].worse_cost and by["a"].worse_latency
    assert by["b"].pass_change == "failed→passed" and not by["b"].regressed
    assert by["c"].pass_change == "new: passed"
    # +5% cost and +50% of a sub-second latency (0.2 s) are noise, not regressions.
    assert by["d"].pass_change == "passed" and not by["d"].regressed
    # A case that needs re-recording in B has no latency to compare.
    assert by["e"].pass_change == "passed→not judged" and by["e"].latency_change is None and not by["e"].regressed


def test_compare_through_the_executable(tmp_path: Path) -> None:
    """`taskloom eval compare` prints the changes, highlights regressions, and exits 3 when a case regressed."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(results_of([rec("refund", "passed", cost_usd=0.1, seconds=1.0)]).model_dump_json())
    b.write_text(results_of([rec("refund", "failed", cost_usd=0.2, seconds=1.0)]).model_dump_json())
    env = {"PATH": "/usr/bin:/bin", "TASKLOOM_HOME": str(tmp_path / "home")}
    done = run_cli("eval", "compare", str(a), str(b), env=env)
    assert done.returncode == EXIT_GATE, done.stderr
    assert "passed→failed" in done.stdout and "+100%" in done.stdout and "1 regression(s): refund [demo]" in done.stdout
    same = run_cli("eval", "compare", str(a), str(a), "--json", env=env)
    assert same.returncode == 0 and json.loads(same.stdout)["changes"][0]["regressed"] is False


def test_results_files_that_are_not_results_are_refused(tmp_path: Path) -> None:
    """A missing file, or JSON that is no results file, is refused naming the file."""
    with pytest.raises(ResultsError, match=r"cannot read results .*missing\.json"):
        read_results(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text('{"cases": []}')
    with pytest.raises(ResultsError, match=r"other\.json: not a taskloom eval results file"):
        read_results(tmp_path / "other.json")


# -- runs on real workers -------------------------------------------------------------------------

SMALL = {
    "exclude_tags": ["broken"],
    "defaults": {"timeout": 30},
    "cases": [
        {
            "id": "refund-in-window",
            "goal": "Can order A100 be refunded? Today is 2026-10-13.",
            "expect": {
                "pattern": "Order A100: can be refunded",
                "tool_args": [{"tool": "lookup_order", "args": {"order_id": "^A100$"}}],
                "tools_not_called": ["issue_refund"],
            },
        },
        {
            "id": "policy",
            "goal": "What is the store's refund policy?",
            "expect": {"contains": ["30 days of delivery"], "max_steps": 5},
        },
        {
            "id": "broken-steps",
            "goal": "What is the store's refund policy?",
            "tags": ["broken"],
            "expect": {"max_steps": 1},
        },
    ],
}


def write_suite(path: Path, suite: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def test_exit_codes_through_the_executable(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """`taskloom eval SUITE --local` exits 0 when every case passes, and 3 naming the broken case and check."""
    suite = write_suite(tmp_path / "suite.yaml", SMALL)
    out = tmp_path / "a.json"
    ok = run_cli("eval", str(suite), "--local", "--out", str(out), env=subprocess_env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "refund-in-window" in ok.stdout and "eval passed" in ok.stdout
    assert [r["status"] for r in json.loads(out.read_text())["runs"]] == ["passed", "passed"]
    bad = run_cli("eval", str(suite), "--local", "--tag", "broken", "--json", env=subprocess_env)
    assert bad.returncode == EXIT_GATE, bad.stderr
    doc = json.loads(bad.stdout)
    assert doc["exit_code"] == EXIT_GATE and "broken-steps#1: max_steps failed" in doc["reasons"][0]


async def test_two_models_compared_in_one_run(settings: Settings, tmp_path: Path) -> None:
    """--model demo --model scripted runs every case on both; the report and compare tell them apart."""
    suite = parse_suite(SMALL, "small")
    scripted = ScriptedModel(planner=lambda request: "Order A100: cannot be refunded.")
    options = Options(Path("small"), models=["demo", "scripted"], repeat=2, local=True, out=tmp_path / "r.json")
    results, _ = await evaluate(settings, options, suite=suite, ports={"scripted": scripted})
    by = {(t.model, t.pass_rate) for t in results.totals}
    assert by == {("demo", 1.0), ("scripted", 0.0)}
    assert len(results.runs) == 8 and all(r.goal_id for r in results.runs)
    demo_refund = next(c for c in results.cases if c.model == "demo" and c.case == "refund-in-window")
    assert demo_refund.retries == 2 and demo_refund.steps > 1  # the demo critic retries the first order once
    failing = next(r for r in results.runs if r.model == "scripted" and r.case == "refund-in-window")
    assert any("check pattern failed" in p for p in failing.problems)
    assert any("tool_args failed: lookup_order was never called" in p for p in failing.problems)
    # Compare the scripted model's run against the demo's, as if one replaced the other.
    as_demo = results.model_copy(
        update={"cases": [c.model_copy(update={"model": "demo"}) for c in results.cases if c.model == "scripted"]}
    )
    moved = {c.case: c.pass_change for c in changes(results, as_demo) if c.model == "demo"}
    assert moved == {"refund-in-window": "passed→failed", "policy": "passed→failed"}


async def _all_alive(redis: ArqRedis, keys: Keys) -> bool:
    return not await health.missing_roles(redis, keys, ROLES)


MODELS_FILE = """
[models.cheap]
provider = "demo"
model = "demo"

[models.pricey]
provider = "demo"
model = "demo-pricey"  # prices belong to a model id: its own
prices = { input = 3, output = 15, cache_read = 0.3, cache_write = 3.75 }
"""


async def test_remote_fleet_runs_two_aliases_with_goal_model(settings: Settings, tmp_path: Path) -> None:
    """Without --local the goals go to the fleet on the Redis URL, each naming its alias (Goal.model);
    an alias the fleet does not know fails its runs with the fleet's reason. The rubric's judge (a
    priced alias) is costed apart from the agents."""
    models = tmp_path / "models.toml"
    models.write_text(MODELS_FILE)
    settings = settings.model_copy(update={"models_file": models})
    stop = asyncio.Event()
    fleet = asyncio.create_task(run_workers(list(ROLES), settings, stop=stop, signals=False))
    try:
        async with connect(settings.redis_url, settings.home) as redis:
            await eventually(lambda: _all_alive(redis, keys_for(settings)))
        case = {**SMALL["cases"][1], "rubric": "Quotes the refund window."}
        suite = parse_suite({"judge": "pricey", "cases": [case]}, "one")
        options = Options(Path("one"), models=["cheap", "pricey", "nosuch"], out=tmp_path / "r.json")
        results, _ = await evaluate(settings, options, suite=suite)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await fleet
    assert results.fleet == "remote" and results.judge == "pricey"
    by = {t.model: t for t in results.totals}
    assert (by["cheap"].pass_rate, by["pricey"].pass_rate, by["nosuch"].pass_rate) == (1.0, 1.0, 0.0)
    assert by["cheap"].cost_usd == 0 and by["pricey"].cost_usd > 0
    assert by["cheap"].judge_cost_usd > 0 and by["cheap"].judge_tokens > 0
    assert [r.rubric_passed for r in results.runs if r.model == "cheap"] == [True]
    [failed] = [r for r in results.runs if r.model == "nosuch"]
    assert "no configured alias" in failed.problems[0]


async def test_remote_run_without_workers_is_refused_at_once(settings: Settings, tmp_path: Path) -> None:
    """A remote eval with no live worker says so before submitting anything, instead of timing out."""
    suite = parse_suite({"cases": [SMALL["cases"][1]]}, "one")
    with pytest.raises(ValueError, match="no live planner, executor, critic worker on this Redis"):
        await evaluate(settings, Options(Path("one"), out=tmp_path / "r.json"), suite=suite)


async def test_replay_from_cassette_and_changed_prompt_needs_rerecording(settings: Settings, tmp_path: Path) -> None:
    """A suite recorded to a cassette replays offline; a changed goal is reported as needing re-recording."""
    cassette = tmp_path / "demo.jsonl"
    one = {"cases": [SMALL["cases"][1]]}
    recording = Options(Path("one"), models=["demo"], local=True, out=tmp_path / "rec.json")
    recorder = RecordingModel(DemoModel(latency=0), cassette)
    recorded, _ = await evaluate(settings, recording, suite=parse_suite(one, "one"), ports={"demo": recorder})
    assert [r.status for r in recorded.runs] == ["passed"]
    assert cassette.read_text().count("\n") >= 2

    replay = Options(Path("one"), replay=cassette, out=tmp_path / "replay.json")
    replayed, _ = await evaluate(settings, replay, suite=parse_suite(one, "one"))
    assert replayed.fleet == "replay" and [r.status for r in replayed.runs] == ["passed"]
    assert verdict(replayed, replay)[0] == 0

    changed = {"cases": [{**SMALL["cases"][1], "goal": "What is the store's refund policy, in short?"}]}
    stale, _ = await evaluate(settings, replay, suite=parse_suite(changed, "changed"))
    [run] = stale.runs
    assert run.status == "rerecord" and run.problems == ["needs re-recording: a request is not in the cassette"]
    assert run.diff and "in short?" in run.diff
    code, reasons = verdict(stale, replay)
    assert code == EXIT_RERECORD and "policy [demo]" in reasons[0]
