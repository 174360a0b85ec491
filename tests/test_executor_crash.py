"""Crash safety with real executor processes: SIGKILL mid-task, another executor resumes at the next step."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually, fake_model_env

from bus.attempts import AttemptStore
from bus.client import Client
from bus.jobs import ExecuteJob
from bus.keys import Keys
from bus.schemas import GoalState, Plan, TaskSpec, TaskState
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, text_reply, tool_reply

TESTS_DIR = Path(__file__).parent


def _script(req: RecordedRequest) -> Reply:
    """Step n (n = tool results seen so far + 1) calls count(sn); step 4 answers. Step 3's reply is slow."""
    done = sum(
        1
        for m in req.messages
        if m["role"] == "user"
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    )
    if done >= 3:
        return text_reply("counted s1, s2 and s3")
    return tool_reply([("count", {"name": f"s{done + 1}"})], delay=3.0 if done == 2 else 0.0)


def _spawn(env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    out = log.open("w")
    return subprocess.Popen([*TASKLOOM, "worker", "executor"], env=env, stdout=out, stderr=subprocess.STDOUT)


async def test_killed_executor_is_resumed_by_another_at_the_next_step(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Kill -9 after step 2 of 4; a second executor finishes within 30 s from step 3; step-1's tool ran once."""
    counter = tmp_path / "counter.txt"
    with FakeAnthropicServer() as fake:
        fake.respond_with(_script)
        env = fake_model_env(subprocess_env, fake.base_url, counter)
        client = Client(redis, keys, default_budget_tokens=100_000)
        gid = await client.submit("count three times")
        spec = TaskSpec(
            id="t1", title="count", instructions="count s1..s3", definition_of_done="3 counts", tools=["count"]
        )
        await client.store.transition_goal(gid, GoalState.PLANNING)
        await client.store.save_plan(gid, Plan(tasks=[spec]), expected_version=0)
        await client.store.transition_goal(gid, GoalState.RUNNING)
        await client.store.transition_task(gid, "t1", TaskState.READY, attempt=1)
        await client.jobs.enqueue(ExecuteJob(goal_id=gid, task_id="t1", attempt=1))
        attempt = AttemptStore(redis, keys, gid, "t1", 1)

        first = _spawn(env, tmp_path / "first.log")
        second = None
        try:

            async def two_steps() -> bool:
                return len(await attempt.steps()) >= 2

            await eventually(two_steps, timeout=30)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            killed_at = time.monotonic()
            assert len(await attempt.steps()) == 2

            second = _spawn(env, tmp_path / "second.log")

            async def reviewing() -> bool:
                return (await client.store.get_task(gid, "t1")).state is TaskState.REVIEWING

            await eventually(reviewing, timeout=30)
            assert time.monotonic() - killed_at < 30
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
    result = await client.store.get_result(gid, "t1", 1)
    assert result is not None and result.stop_reason == "answered" and result.steps == 4
    assert counter.read_text().splitlines() == ["s1", "s2", "s3"]  # each step's tool ran exactly once
    steps = await attempt.steps()
    assert [s.index for s in steps] == [0, 1, 2, 3]
    log = (tmp_path / "second.log").read_text()
    assert '"resumed_steps": 2' in log
