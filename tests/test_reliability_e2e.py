"""End to end with real worker processes: provider trouble is waited out by the job layer, a side
effect is never repeated across attempts (judged from the tool's own log), and a goal that ran out
of provider patience fails clearly and finishes after `taskloom resume`."""

from __future__ import annotations

import threading
from pathlib import Path

from arq.connections import ArqRedis
from helpers import run_cli
from test_e2e import Scenario, _first_user, _tool_results, fleet, requests_of, role_of, spec, task_of, worker_env

from bus.client import Client
from bus.keys import Keys
from bus.schemas import GoalState, TaskState
from llm.testing import FakeAnthropicServer, RecordedRequest, Script, overloaded, rate_limited


def charges(counter: Path) -> list[str]:
    """The `charge` tool's own log (tests/toolkits_for_tests.py): one line per real run."""
    text = counter.read_text() if counter.exists() else ""
    return [line for line in text.splitlines() if line.startswith("charge ")]


async def test_a_side_effect_is_not_repeated_after_a_blip_and_a_critic_rejection(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Attempt 1 charges, then its next model call meets three 429s (the SDK's retries exhausted):
    the job waits and the attempt continues at that step. The critic then rejects attempt 1;
    attempt 2 is told about the earlier charge, calls it again anyway, and gets the recorded result:
    the tool's own log shows one charge."""
    scenario = Scenario(
        plans={0: [{"tasks": [spec("pay", tools=("charge",))]}]},
        calls={"pay": [("charge", {"amount": 5})]},
        verdicts={("pay", 1): {"passed": False, "action": "retry", "feedback": "SAY-THE-AMOUNT"}},
    )
    blips = 0
    lock = threading.Lock()

    def respond(req: RecordedRequest) -> Script:
        nonlocal blips
        after_charge = role_of(req) == "executor" and _tool_results(req) and "SAY-THE-AMOUNT" not in _first_user(req)
        if after_charge:
            with lock:
                blips += 1
                if blips <= 3:
                    return rate_limited(retry_after=0)
        return scenario(req)

    with FakeAnthropicServer() as fake:
        fake.respond_with(respond)
        env = worker_env(subprocess_env, fake, tmp_path)
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            gid = await client.submit("charge once")
            goal = await client.wait(gid, timeout=60)
    assert goal.state is GoalState.SUCCEEDED, goal
    assert blips >= 4  # three 429s, then the same step asked again
    assert len(charges(tmp_path / "counter.txt")) == 1, charges(tmp_path / "counter.txt")
    pay = (await client.store.get_tasks(gid))["pay"]
    assert (pay.state, pay.attempt) == (TaskState.DONE, 2)  # the blip cost no attempt
    second = [r for r in requests_of(fake, "executor", "pay") if "SAY-THE-AMOUNT" in _first_user(r)]
    assert "already made these side-effecting calls" in _first_user(second[0])
    assert "- attempt 1: charge" in _first_user(second[0])
    replayed = [b for r in second for b in _tool_results(r)]
    assert replayed and "already done in attempt 1" in str(replayed[0]["content"])
    events = [e.type for e in await client.log.read(gid)]
    assert "goal.provider_trouble" in events


async def test_an_outage_past_patience_fails_the_goal_and_resume_finishes_it(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Task a is accepted; then every request fails 529 for longer than the goal's patience (3 s):
    the goal ends `failed` naming the 529 and its request id. Once the provider is back,
    `taskloom resume` finishes it without running a again."""
    scenario = Scenario(plans={0: [{"tasks": [spec("a"), spec("b", deps=("a",))]}]})
    outage = threading.Event()

    def respond(req: RecordedRequest) -> Script:
        if role_of(req) == "executor" and task_of(req) == "b":
            outage.set()
        if outage.is_set():
            return overloaded()
        return scenario(req)

    with FakeAnthropicServer() as fake:
        fake.respond_with(respond)
        env = worker_env(
            subprocess_env,
            fake,
            tmp_path,
            TASKLOOM_PROVIDER_PATIENCE="3",
            TASKLOOM_PROVIDER_BACKOFF_MAX="1",
            TASKLOOM_MODEL_MAX_RETRIES="0",
        )
        client = Client(redis, keys, default_budget_tokens=200_000)
        async with fleet(env, tmp_path, "planner", "critic", "executor"):
            gid = await client.submit("two steps")
            failed = await client.wait(gid, timeout=60)
            assert failed.state is GoalState.FAILED, failed
            assert failed.reason and "529" in failed.reason and "request_id=req_fake_" in failed.reason
            assert "patience" in failed.reason
            outage.clear()
            fake.respond_with(scenario)
            resumed = run_cli("resume", gid, env=env)
            assert resumed.returncode == 0, resumed.stderr
            done = await client.wait(gid, timeout=60)
    assert done.state is GoalState.SUCCEEDED, done
    a_runs = requests_of(fake, "executor", "a")
    assert len(a_runs) == 1  # the accepted task was not run again
    tasks = await client.store.get_tasks(gid)
    assert tasks["a"].attempt == 1 and tasks["b"].state is TaskState.DONE
    assert not scenario.unrouted
