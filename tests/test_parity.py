"""Parity: one scenario set (parallel DAG, critic retry, replan, budget stop, cancel) runs the same way
in-process on fakeredis (`taskloom.testing`) and on real worker processes over a real Redis, with the
same scripts answering (in-process as a ModelPort, for the workers through the fake Messages API).

Each scenario is driven by the same code on both paths and checked by the same assertions, read
back from Redis with the same `collect`. The in-process half runs each scenario in about a tenth
of a second; the worker half starts one planner, critic and executor process and runs all five
goals on them at once (marked `e2e`; see the README's testing section for how long it takes).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import toolkits_for_tests
from arq.connections import ArqRedis
from helpers import eventually, openai_model_env
from test_e2e import fleet, worker_env

from bus.client import Client
from bus.keys import ROLES, Keys
from bus.schemas import GoalState, TaskState
from critic.prompts import FINAL_TOOL
from llm.testing import Failure, FakeAnthropicServer, RecordedRequest, error_body, request_from_wire
from llm.testing import Script as FakeScript
from llm.types import ModelRequest, TextBlock, ToolUseBlock, Usage
from taskloom.testing import (
    InProcessFleet,
    ReplayModel,
    RunResult,
    ScriptedModel,
    UnscriptedRequest,
    accept,
    collect,
    http_responder,
    plan,
    replan,
    retry,
    task,
    tool_call,
    tool_calls,
)

FEEDBACK = "STATE-THE-DEADLINE"
BUDGET = 4_500  # bud-b's second call must not fit: 4,300-4,800 do with today's prompts and the fake's token counts


class Runner:
    """What a scenario needs from a path: submit, a client, and a wait until nothing is left to do."""

    client: Client

    async def submit(self, goal: dict[str, Any]) -> str:
        return await self.client.submit(goal)

    async def settle(self, goal_id: str) -> RunResult:
        raise NotImplementedError


@dataclass
class Scenario:
    name: str
    goal: str
    model: Callable[[], ScriptedModel]
    check: Callable[[RunResult, ScriptedModel, list[str]], None]
    budget: int = 200_000
    during: Callable[[Runner, str, ScriptedModel], Awaitable[None]] | None = None
    scripted: ScriptedModel = field(init=False)

    def __post_init__(self) -> None:
        self.scripted = self.model()


def counted(lines: list[str], prefix: str) -> list[str]:
    return sorted(line for line in lines if line.split()[0].startswith(prefix) or line.startswith(f"timed {prefix}"))


# -- the scenarios --------------------------------------------------------------------------------


def parallel_dag() -> ScriptedModel:
    tasks = [task(f"par-{t}", tools=["timed"]) for t in "abc"]
    return ScriptedModel(
        planner=[plan(*tasks, task("par-d", depends_on=["par-a", "par-b", "par-c"]))],
        executor={
            **{f"par-{t}": [tool_call("timed", name=f"par-{t}", seconds=0.5), f"{t} timed"] for t in "abc"},
            "par-d": ["d after a, b and c"],
        },
    )


def check_parallel_dag(result: RunResult, model: ScriptedModel, lines: list[str]) -> None:
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert {t: (r.state, r.attempt) for t, r in result.tasks.items()} == {
        f"par-{t}": (TaskState.DONE, 1) for t in "abcd"
    }
    spans = [line.split() for line in lines if line.startswith("timed par-")]
    assert len(spans) == 3, lines
    # a, b and c ran at the same time; d started only after all three were accepted.
    assert max(float(s[3]) for s in spans) < min(float(s[4]) for s in spans), spans
    moves = [(e.task_id, e.data.get("state")) for e in result.events if e.type == "task.state"]
    assert max(moves.index((f"par-{t}", "done")) for t in "abc") < moves.index(("par-d", "ready")), moves


def critic_retry() -> ScriptedModel:
    return ScriptedModel(
        planner=[plan(task("ret-x"))],
        executor={"ret-x": ["first answer", "answer with the deadline"]},
        review={"ret-x": [retry(FEEDBACK), accept()]},
    )


def check_critic_retry(result: RunResult, model: ScriptedModel, lines: list[str]) -> None:
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert (result.tasks["ret-x"].state, result.tasks["ret-x"].attempt) == (TaskState.DONE, 2)
    first, second = (_first_text(r) for r in model.requests("executor", "ret-x"))
    assert FEEDBACK not in first and f"Reviewer feedback: {FEEDBACK}" in second
    assert [r.answer for r in result.results] == ["first answer", "answer with the deadline"]


def replanning() -> ScriptedModel:
    p = task("rep-p", tools=["count"])
    return ScriptedModel(
        planner=[
            plan(p, task("rep-q", depends_on=["rep-p"], tools=["count"])),
            plan(p, task("rep-q2", depends_on=["rep-p"], tools=["count"])),
        ],
        executor={t: [tool_call("count", name=t), f"{t} counted"] for t in ("rep-p", "rep-q", "rep-q2")},
        review={"rep-q": [replan("rep-q cannot work as planned")]},
    )


def check_replan(result: RunResult, model: ScriptedModel, lines: list[str]) -> None:
    assert result.state is GoalState.SUCCEEDED, result.summary()
    assert result.goal.plan_version == 2
    assert {t: (r.state, r.attempt) for t, r in result.tasks.items()} == {
        "rep-p": (TaskState.DONE, 1),  # kept by the new plan: not run again
        "rep-q": (TaskState.SUPERSEDED, 1),
        "rep-q2": (TaskState.DONE, 1),
    }
    assert counted(lines, "rep-") == ["rep-p", "rep-q", "rep-q2"]
    assert result.plans[0].plan.tasks[0] == result.plans[1].plan.tasks[0]


def budget_stop() -> ScriptedModel:
    chain = [task("bud-a", tools=["count"]), task("bud-b", depends_on=["bud-a"], tools=["count"])]
    chain.append(task("bud-c", depends_on=["bud-b"], tools=["count"]))
    return ScriptedModel(
        planner=[plan(*chain)],
        # Long answers, so that the budget runs out in the middle of the chain.
        executor={
            t: [tool_calls(("count", {"name": t})), f"{t} counted " + "x" * 800] for t in ("bud-a", "bud-b", "bud-c")
        },
    )


def check_budget_stop(result: RunResult, model: ScriptedModel, lines: list[str]) -> None:
    assert result.state is GoalState.BUDGET_EXHAUSTED, result.summary()
    books = result.ledger
    assert books is not None and books.spent <= BUDGET and books.open == 0 and books.refusals >= 1, books
    # The work accepted before the money ran out is kept; b ran out mid-attempt; c never started.
    assert {t: (r.state, r.attempt, r.reason) for t, r in result.tasks.items()} == {
        "bud-a": (TaskState.DONE, 1, None),
        "bud-b": (TaskState.FAILED, 1, "budget_exhausted"),
        "bud-c": (TaskState.PENDING, 0, None),
    }, result.summary()
    assert counted(lines, "bud-") == ["bud-a", "bud-b"]


def cancelling() -> ScriptedModel:
    return ScriptedModel(
        planner=[plan(task("can-s", tools=["sleepy"]))],
        executor={"can-s": [tool_call("sleepy", seconds=20)]},
    )


async def cancel_while_the_tool_sleeps(runner: Runner, goal_id: str, model: ScriptedModel) -> None:
    async def sleeping() -> bool:
        record = (await runner.client.store.get_tasks(goal_id)).get("can-s")
        return bool(model.requests("executor", "can-s")) and record is not None and record.state is TaskState.RUNNING

    await eventually(sleeping, timeout=20)
    await asyncio.sleep(0.3)  # the reply is in and the tool is running
    await runner.client.cancel(goal_id)


def check_cancel(result: RunResult, model: ScriptedModel, lines: list[str]) -> None:
    assert result.state is GoalState.CANCELLED, result.summary()
    assert result.tasks["can-s"].state is TaskState.CANCELLED
    assert len(model.requests("executor", "can-s")) == 1  # no model call after the cancel
    assert result.seconds < 15  # stopped long before the tool's 20 s


def _first_text(request: ModelRequest) -> str:
    return "\n".join(b.text for b in request.messages[0].content if isinstance(b, TextBlock))


def scenarios() -> list[Scenario]:
    return [
        Scenario("parallel_dag", "Run three checks in parallel, then a fourth.", parallel_dag, check_parallel_dag),
        Scenario("critic_retry", "Answer once, be told to retry.", critic_retry, check_critic_retry),
        Scenario("replan", "Plan, be told to replan.", replanning, check_replan),
        Scenario("budget_stop", "Run a chain on a small budget.", budget_stop, check_budget_stop, budget=BUDGET),
        Scenario("cancel", "Sleep, then be cancelled.", cancelling, check_cancel, during=cancel_while_the_tool_sleeps),
    ]


async def drive(runner: Runner, scenario: Scenario) -> RunResult:
    """The same steps on both paths: submit, act while it runs, wait until nothing is left to do."""
    started = time.monotonic()
    goal_id = await runner.submit({"text": scenario.goal, "budget_tokens": scenario.budget})
    if scenario.during is not None:
        await scenario.during(runner, goal_id, scenario.scripted)
    result = await runner.settle(goal_id)
    return replace(result, seconds=time.monotonic() - started)


def dropped_speculations(result: RunResult, model: ScriptedModel) -> list[Usage]:
    """The usage of each final answer the critic started speculatively, beside the last review of a
    set of attempts, that a verdict of that review then overtook (a replan, a retry): billed and
    booked, never the goal's answer. Whether a run makes one is a race between two jobs (on worker
    processes a fast pick-up can start the final answer first), so runs are compared without them;
    the goal's answer, states and every other call must still agree exactly."""
    dropped = []
    for call in model.calls:
        if call.role != "goal_review":
            continue
        given = [b.input for b in call.response.content if isinstance(b, ToolUseBlock) and b.name == FINAL_TOOL]
        if given and given[0].get("answer") != result.goal.answer:
            dropped.append(call.response.usage)
    return dropped


def signature(result: RunResult, tokens: bool = True, dropped: Sequence[Usage] = ()) -> tuple[Any, ...]:
    """How a run ended, in terms both paths must agree on exactly. `tokens=False` leaves out the tokens
    spent: the Chat Completions wire is not the size of the Messages wire the in-process run counts.
    `dropped`: overtaken speculative final answers (`dropped_speculations`), taken out of the books."""
    calls = sorted((c.task_id, c.attempt, c.name, str(c.input), c.outcome) for c in result.tool_calls)
    books = result.ledger
    extra = sum(u.input_tokens + u.output_tokens + u.cache_read_tokens + u.cache_write_tokens for u in dropped)
    return (
        result.state,
        result.goal.plan_version,
        {t: (r.state, r.attempt, r.reason) for t, r in result.tasks.items()},
        [(r.task_id, r.attempt, r.answer, r.stop_reason) for r in result.results],
        calls,
        (books.calls - len(dropped), books.spent - extra if tokens else None, books.refusals) if books else None,
    )


def counter_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# -- path 1: in-process on fakeredis --------------------------------------------------------------


class InProcess(Runner):
    def __init__(self, fleet: InProcessFleet) -> None:
        assert fleet.client is not None
        self.fleet = fleet
        self.client = fleet.client

    async def settle(self, goal_id: str) -> RunResult:
        return await self.fleet.settle(goal_id, timeout=30)


@pytest.mark.parametrize("scenario", scenarios(), ids=lambda s: s.name)
async def test_scenario_in_process(scenario: Scenario, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each parity scenario, run in-process on fakeredis, ends as its checks require."""
    counter = tmp_path / "counter.txt"
    monkeypatch.setenv("TL_COUNTER_FILE", str(counter))
    async with InProcessFleet(model=scenario.scripted, tools=toolkits_for_tests.kit) as f:
        result = await drive(InProcess(f), scenario)
    assert not scenario.scripted.problems
    scenario.check(result, scenario.scripted, counter_lines(counter))


# -- path 2: real worker processes on a real Redis ------------------------------------------------


class Workers(Runner):
    def __init__(self, redis: ArqRedis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.client = Client(redis, keys, default_budget_tokens=200_000)

    async def settle(self, goal_id: str) -> RunResult:
        await self.client.wait(goal_id, timeout=60)

        async def idle() -> bool:  # a job stays in its queue until it has finished
            sizes = [await self.redis.zcard(self.keys.queue(r)) for r in ROLES]
            return not any(sizes)

        await eventually(idle, timeout=30)
        await asyncio.sleep(0.05)
        await eventually(idle, timeout=30)
        return await collect(self.redis, self.keys, goal_id)


def by_goal(all_scenarios: list[Scenario]) -> Callable[[RecordedRequest], FakeScript]:
    """One fake Messages API for every scenario: each request goes to the script of the goal it is about."""
    responders = [(s.goal, http_responder(s.scripted)) for s in all_scenarios]

    def respond(recorded: RecordedRequest) -> FakeScript:
        first = _first_text(request_from_wire(recorded.body))
        for goal, responder in responders:
            if goal in first:
                return responder(recorded)
        return Failure(status=400, body=error_body(400, "no parity scenario has this goal"))

    return respond


def openai_by_goal(all_scenarios: list[Scenario]) -> Callable[[Any], Any]:
    """`by_goal` for the fake Chat Completions server: the same scripts, the OpenAI dialect on the wire."""
    from llm.testing import openai_reply_from_response, openai_request_from_wire

    def respond(recorded: Any) -> Any:
        request = openai_request_from_wire(recorded.body)
        first = _first_text(request)
        for s in all_scenarios:
            if s.goal in first:
                try:
                    return openai_reply_from_response(s.scripted.respond(request))
                except UnscriptedRequest as exc:
                    return Failure(status=400, body={"error": {"message": str(exc), "type": "invalid_request_error"}})
        return Failure(status=400, body={"error": {"message": "no parity scenario has this goal"}})

    return respond


@contextlib.contextmanager
def dialect_server(
    dialect: str, all_scenarios: list[Scenario], subprocess_env: dict[str, str], tmp_path: Path, **extra: str
) -> Iterator[tuple[dict[str, str], Callable[[], int]]]:
    """The fake server of `dialect` answering every scenario, the workers' environment for it, and what
    it has billed so far (tokens)."""
    if dialect == "anthropic":
        with FakeAnthropicServer() as fake:
            fake.respond_with(by_goal(all_scenarios))
            yield worker_env(subprocess_env, fake, tmp_path, **extra), lambda: fake.billed.total
        return
    from llm.testing import FakeOpenAIServer

    with FakeOpenAIServer() as oa:
        oa.respond_with(openai_by_goal(all_scenarios))
        counter, models = tmp_path / "counter.txt", tmp_path / "models.toml"
        env = openai_model_env(subprocess_env, oa.base_url, counter, models, TASKLOOM_POLL_DELAY="0.01", **extra)
        yield env, lambda: oa.billed.total


@pytest.mark.e2e
@pytest.mark.parametrize("dialect", ["anthropic", "openai"])
async def test_scenarios_on_worker_processes(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path, dialect: str
) -> None:
    """All parity scenarios at once on real planner, critic and executor processes, the model behind the
    fake Messages API or the fake Chat Completions API: the same checks pass, and each goal ends exactly
    as it does in-process, tokens spent included."""
    all_scenarios = scenarios()
    # The workers also record every model call they make: replayed in-process below.
    with dialect_server(
        dialect, all_scenarios, subprocess_env, tmp_path, TASKLOOM_RECORD=str(tmp_path / "fleet.jsonl")
    ) as (env, billed):
        runner = Workers(redis, keys)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            results = await asyncio.gather(*(drive(runner, s) for s in all_scenarios))
        # The books hold exactly what the provider billed (no call of these scenarios is left open).
        assert sum(r.ledger.spent for r in results if r.ledger) == billed()
    lines = counter_lines(tmp_path / "counter.txt")
    for scenario, result in zip(all_scenarios, results, strict=True):
        assert not scenario.scripted.problems, scenario.name
        scenario.check(result, scenario.scripted, lines)
    # And each ended exactly as it does in-process: same states, results, tool calls and tokens spent;
    # and the cassette the worker processes recorded replays in-process to the same end.
    for scenario, on_workers, result in zip(scenarios(), all_scenarios, results, strict=True):
        async with InProcessFleet(model=scenario.scripted, tools=toolkits_for_tests.kit) as f:
            in_process = await drive(InProcess(f), scenario)
        tokens = dialect == "anthropic"
        ours = signature(result, tokens, dropped_speculations(result, on_workers.scripted))
        in_process_dropped = dropped_speculations(in_process, scenario.scripted)
        assert signature(in_process, tokens, in_process_dropped) == ours, scenario.name
        if scenario.during is None:  # acting mid-run is timed on the scripted model's requests
            replay = ReplayModel(tmp_path / "fleet.jsonl")
            async with InProcessFleet(model=replay, tools=toolkits_for_tests.kit) as f:
                replayed = await drive(InProcess(f), scenario)
            # The replay runs in-process as the scripted run did: the same speculations, if any, drop.
            assert signature(replayed, tokens, in_process_dropped) == ours, scenario.name
