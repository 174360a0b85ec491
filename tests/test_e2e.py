"""End to end with real worker processes: planner, critic and executors as `taskloom worker <role>` subprocesses
on the test Redis, the real Anthropic SDK talking to the fake Messages API, scripted per role by one responder."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually, fake_model_env, run_cli

from bus.client import Client
from bus.keys import Keys
from bus.schemas import GoalState, TaskState
from critic.prompts import FINAL_SYSTEM, FINAL_TOOL, REVIEW_SYSTEM
from executor.loop import SYSTEM as EXECUTOR_SYSTEM
from llm.testing import (
    Failure,
    FakeAnthropicServer,
    RecordedRequest,
    Script,
    content_text,
    error_body,
    text_reply,
    tool_reply,
)
from planner.prompts import PLAN_TOOL
from planner.prompts import SYSTEM as PLANNER_SYSTEM

TESTS_DIR = Path(__file__).parent

# -- reading a recorded request -----------------------------------------------------------------


def _system(req: RecordedRequest) -> str:
    return content_text(req.body.get("system"))


def _first_user(req: RecordedRequest) -> str:
    return content_text(req.messages[0]["content"]) if req.messages else ""


def _tool_results(req: RecordedRequest) -> list[dict[str, Any]]:
    return [
        b
        for m in req.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


def role_of(req: RecordedRequest) -> str:
    """planner | review | goal_review (the final answer and its verdict, one call) | executor | unknown."""
    forced = (req.body.get("tool_choice") or {}).get("name")
    system = _system(req)
    offered = {t.get("name") for t in req.body.get("tools") or []}
    if system == PLANNER_SYSTEM and PLAN_TOOL in offered:
        return "planner"  # route first (the goal's tools beside submit_plan) or forced
    if system == REVIEW_SYSTEM and not offered:
        return "review"
    if forced == FINAL_TOOL and system == FINAL_SYSTEM:
        return "goal_review"
    if system == EXECUTOR_SYSTEM and "Your task (" in _first_user(req):
        return "executor"
    return "unknown"


def task_of(req: RecordedRequest) -> str | None:
    """The task an executor or review request is about."""
    m = re.search(r"Your task \(([^)]+)\)", _first_user(req)) or re.search(r"^Task '([^']+)':", _first_user(req), re.M)
    return m.group(1) if m else None


def review_attempt(req: RecordedRequest) -> int:
    m = re.search(r"^Answer \(attempt (\d+)\):", _first_user(req), re.M)
    assert m, _first_user(req)
    return int(m.group(1))


# -- the scripted model -------------------------------------------------------------------------


def spec(tid: str, *, deps: tuple[str, ...] = (), tools: tuple[str, ...] = ()) -> dict[str, Any]:
    """A task as the model writes it in `submit_plan`."""
    return {
        "id": tid,
        "title": f"task {tid}",
        "instructions": f"Do {tid}.",
        "depends_on": list(deps),
        "definition_of_done": f"{tid} is done",
        "tools": list(tools),
    }


ACCEPT = {"passed": True, "action": "accept", "feedback": "ok"}
FINAL = {"answer": "The final answer.", "passed": True, "action": "accept", "feedback": "ok"}


@dataclass
class Scenario:
    """What the model answers, per role.

    plans[v][n]: the planner's n-th reply (0 = first, 1 = after one correction) when making the plan that
    replaces version v (0: the first plan). calls[task]: the tool calls of an executor's first turn (then it
    answers); verdicts[(task, attempt)]: the critic's verdict (default: accept).
    """

    plans: dict[int, list[dict[str, Any]]]
    calls: dict[str, list[tuple[str, dict[str, Any]]]] = field(default_factory=dict)
    verdicts: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    unrouted: list[RecordedRequest] = field(default_factory=list)

    def __call__(self, req: RecordedRequest) -> Script:
        role = role_of(req)
        if role == "planner":
            m = re.search(r"The current plan \(version (\d+)\)", _first_user(req))
            replies = self.plans.get(int(m.group(1)) if m else 0, [])
            turn = len(req.messages) // 2  # 0, then 1 after one correction, ...
            if turn < len(replies):
                return tool_reply([(PLAN_TOOL, replies[turn])])
        elif role == "review":
            verdict = self.verdicts.get((task_of(req) or "", review_attempt(req)), ACCEPT)
            return text_reply(json.dumps(verdict))
        elif role == "goal_review":
            return tool_reply([(FINAL_TOOL, FINAL)])
        elif role == "executor":
            tid = task_of(req) or "?"
            calls = self.calls.get(tid, [])
            if calls and not _tool_results(req):
                return tool_reply(calls)
            return text_reply(f"result of {tid}")
        self.unrouted.append(req)
        return Failure(status=400, body=error_body(400, "the test responder cannot route this request"))


def requests_of(fake: FakeAnthropicServer, role: str, task: str | None = None) -> list[RecordedRequest]:
    return [r for r in fake.message_requests if role_of(r) == role and (task is None or task_of(r) == task)]


# -- worker processes ---------------------------------------------------------------------------


@dataclass
class Worker:
    role: str
    log: Path
    proc: subprocess.Popen[bytes]

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def ready(self) -> bool:
        return "Starting worker" in self.log.read_text()


def worker_env(
    subprocess_env: dict[str, str], fake: FakeAnthropicServer, tmp_path: Path, **extra: str
) -> dict[str, str]:
    return fake_model_env(subprocess_env, fake.base_url, tmp_path / "counter.txt", TASKLOOM_POLL_DELAY="0.01", **extra)


def _spawn(role: str, env: dict[str, str], log: Path) -> Worker:
    with log.open("w") as out:
        proc = subprocess.Popen([*TASKLOOM, "worker", role], env=env, stdout=out, stderr=subprocess.STDOUT)
    return Worker(role, log, proc)


@asynccontextmanager
async def fleet(env: dict[str, str], tmp_path: Path, *roles: str) -> AsyncIterator[list[Worker]]:
    """Start one `taskloom worker <role>` process per role, wait until each polls its queue, kill all at exit."""
    workers: list[Worker] = []
    try:
        for i, role in enumerate(roles):
            workers.append(_spawn(role, env, tmp_path / f"{i}-{role}.log"))

        async def all_ready() -> bool:
            dead = [w for w in workers if w.proc.poll() is not None]
            assert not dead, f"{dead[0].role} exited: {dead[0].log.read_text()[-2000:]}"
            return all(w.ready() for w in workers)

        await eventually(all_ready, timeout=120)  # five interpreters importing the SDK on a busy 2-core CI box
        yield workers
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait(10)
        for w in workers:  # shown by pytest when the test fails
            print(f"--- {w.log.name} ---\n{w.log.read_text()[-4000:]}")


def started_tasks(w: Worker) -> list[str]:
    return [line["task_id"] for line in w.lines() if line.get("event") == "execute.start"]


# -- tests --------------------------------------------------------------------------------------


async def test_independent_tasks_run_in_parallel_on_different_executors(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """a, b, c run at once on three executor processes; d starts only after all three were accepted."""
    scenario = Scenario(
        plans={0: [{"tasks": [spec(t, tools=("timed",)) for t in "abc"] + [spec("d", deps=("a", "b", "c"))]}]},
        calls={t: [("timed", {"name": t, "seconds": 1.0})] for t in "abc"},
    )
    with FakeAnthropicServer() as fake:
        fake.respond_with(scenario)
        env = worker_env(subprocess_env, fake, tmp_path, TASKLOOM_EXECUTOR_CONCURRENCY="1")
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor", "executor", "executor") as workers:
            gid = await client.submit("fan out")
            goal = await client.wait(gid, timeout=30)
            executors = [w for w in workers if w.role == "executor"]
            ran = {w.log.name: started_tasks(w) for w in executors}
    assert goal.state is GoalState.SUCCEEDED, goal
    assert not scenario.unrouted
    # Each of a, b, c started on its own executor process (d on any of them).
    where = {tid: name for name, tids in ran.items() for tid in tids}
    assert set(where) == set("abcd"), ran
    assert len({where["a"], where["b"], where["c"]}) == 3, ran
    # Their tools ran in three processes at the same time.
    spans = {
        parts[1]: (int(parts[2]), float(parts[3]), float(parts[4]))
        for parts in (line.split() for line in (tmp_path / "counter.txt").read_text().splitlines())
    }
    assert set(spans) == set("abc"), spans
    assert len({pid for pid, _, _ in spans.values()}) == 3, spans
    assert max(s for _, s, _ in spans.values()) < min(e for _, _, e in spans.values()), spans
    # d's executor was first asked after the critic had been asked about (and accepted) a, b and c.
    reviews = [r for t in "abc" for r in requests_of(fake, "review", t)]
    assert len(reviews) == 3
    d_first = min(r.at for r in requests_of(fake, "executor", "d"))
    assert max(r.at for r in reviews) < d_first
    tasks = await client.store.get_tasks(gid)
    assert {t: r.state for t, r in tasks.items()} == dict.fromkeys("abcd", TaskState.DONE)


async def test_critic_rejects_once_and_the_retry_sees_the_feedback(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """The critic rejects x's first attempt; attempt 2 is prompted with the feedback, accepted, goal succeeds."""
    feedback = "MENTION-THE-DEADLINE"
    scenario = Scenario(
        plans={0: [{"tasks": [spec("x")]}]},
        verdicts={("x", 1): {"passed": False, "action": "retry", "feedback": feedback}},
    )
    with FakeAnthropicServer() as fake:
        fake.respond_with(scenario)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            gid = await client.submit("retry once")
            goal = await client.wait(gid, timeout=30)
    assert goal.state is GoalState.SUCCEEDED, goal
    assert not scenario.unrouted
    first, second = requests_of(fake, "executor", "x")  # one model turn per attempt
    assert feedback not in _first_user(first)
    assert f"Reviewer feedback: {feedback}" in _first_user(second)
    assert [review_attempt(r) for r in requests_of(fake, "review", "x")] == [1, 2]
    x = (await client.store.get_tasks(gid))["x"]
    assert (x.state, x.attempt) == (TaskState.DONE, 2)


async def test_replan_keeps_accepted_work(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """The critic asks a replan for q; plan v2 keeps the accepted p (not run again) and runs q2 instead."""
    p = spec("p", tools=("count",))
    scenario = Scenario(
        plans={
            0: [{"tasks": [p, spec("q", deps=("p",), tools=("count",))]}],
            1: [{"tasks": [p, spec("q2", deps=("p",), tools=("count",))]}],
        },
        calls={t: [("count", {"name": t})] for t in ("p", "q", "q2")},
        verdicts={("q", 1): {"passed": False, "action": "replan", "feedback": "q cannot work as planned"}},
    )
    with FakeAnthropicServer() as fake:
        fake.respond_with(scenario)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            gid = await client.submit("replan once")
            goal = await client.wait(gid, timeout=30)
    assert goal.state is GoalState.SUCCEEDED, goal
    assert goal.plan_version == 2
    assert not scenario.unrouted
    assert sorted((tmp_path / "counter.txt").read_text().splitlines()) == ["p", "q", "q2"]
    v1, v2 = [await client.store.get_plan(gid, v) for v in (1, 2)]
    assert v1.plan.tasks[0] == v2.plan.tasks[0]  # p kept with the same id and spec
    tasks = await client.store.get_tasks(gid)
    assert {t: (r.state, r.attempt) for t, r in tasks.items()} == {
        "p": (TaskState.DONE, 1),
        "q": (TaskState.SUPERSEDED, 1),
        "q2": (TaskState.DONE, 1),
    }
    assert len(requests_of(fake, "executor", "p")) == 2  # one attempt: tool turn + answer


async def test_cyclic_plan_is_sent_back_with_the_cycle_named(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """A plan with a cycle goes back to the model as an error naming 'a -> b -> a'; the fixed plan succeeds."""
    scenario = Scenario(
        plans={
            0: [
                {"tasks": [spec("a", deps=("b",)), spec("b", deps=("a",))]},
                {"tasks": [spec("a"), spec("b", deps=("a",))]},
            ]
        }
    )
    with FakeAnthropicServer() as fake:
        fake.respond_with(scenario)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            gid = await client.submit("plan without cycles")
            goal = await client.wait(gid, timeout=30)
    assert goal.state is GoalState.SUCCEEDED, goal
    assert not scenario.unrouted
    first, second = requests_of(fake, "planner")
    assert len(first.messages) == 1
    [result] = _tool_results(second)
    assert result["is_error"] is True
    assert "The dependencies form a cycle: a -> b -> a" in content_text(result["content"])
    assert [t.depends_on for t in (await client.store.get_plan(gid, 1)).plan.tasks] == [[], ["a"]]


async def test_cancel_mid_run_stops_the_goal_and_its_model_calls(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """`taskloom cancel` while a task sleeps in a tool: goal cancelled at once, no model call about it afterwards."""
    scenario = Scenario(
        plans={0: [{"tasks": [spec("s", tools=("sleepy",))]}]}, calls={"s": [("sleepy", {"seconds": 20})]}
    )
    with FakeAnthropicServer() as fake:
        fake.respond_with(scenario)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor") as workers:
            gid = await client.submit("sleep, then be cancelled")

            async def sleeping() -> bool:
                task = (await client.store.get_tasks(gid)).get("s")
                return bool(requests_of(fake, "executor", "s")) and task is not None and task.state is TaskState.RUNNING

            await eventually(sleeping, timeout=20)
            await asyncio.sleep(0.3)  # the reply is in and the tool is running
            cancel_at = time.monotonic()
            done = await asyncio.to_thread(run_cli, "cancel", gid, env=subprocess_env)
            assert done.returncode == 0, done.stderr
            goal = await client.wait(gid, timeout=3)
            assert goal.state is GoalState.CANCELLED, goal
            assert time.monotonic() - cancel_at < 5

            executor = next(w for w in workers if w.role == "executor")

            async def executor_stopped() -> bool:
                return any(
                    line.get("event") == "execute.result" and line.get("stop_reason") == "cancelled"
                    for line in executor.lines()
                )

            await eventually(executor_stopped, timeout=5)  # well before sleepy's 20 s
            await asyncio.sleep(1.0)  # grace for anything in flight
            seen = len(fake.message_requests)
            await asyncio.sleep(3.0)
            assert len(fake.message_requests) == seen
    assert not [r for r in fake.message_requests if r.at > cancel_at and gid in json.dumps(r.body)]
    assert not [r for r in fake.message_requests if r.at > cancel_at and task_of(r) == "s"]
    assert (await client.store.get_tasks(gid))["s"].state is TaskState.CANCELLED
    assert not scenario.unrouted
