"""Graceful shutdown of executors: a SIGTERM lets the running step finish, then the attempt is handed
over between steps (lease released, resume job enqueued) to another executor, with nothing lost.

This module is also the toolkit its worker processes load (`TASKLOOM_TOOLS=test_shutdown:kit`).
"""

from __future__ import annotations

import asyncio
import os
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
from bus.ledger import Ledger
from bus.metered import ModelFactory
from bus.runtime import Limits, Runtime
from bus.schemas import GoalState, Plan, TaskSpec, TaskState
from executor.handlers import execute
from executor.registry import ToolRegistry
from executor.toolkit import Toolkit
from llm.anthropic import AnthropicModel
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, text_reply, tool_reply

TESTS_DIR = Path(__file__).parent
STEPS = 3  # tool steps; a fourth model turn answers

kit = Toolkit("shutdown")


def _record(line: str) -> None:
    with open(os.environ["TL_COUNTER_FILE"], "a") as fh:
        fh.write(line + "\n")


@kit.tool
async def slow_step(n: int) -> str:
    """A slow tool that records when it starts and ends, and in which process."""
    _record(f"start {n} {os.getpid()}")
    await asyncio.sleep(float(os.environ.get("TL_SLOW_SECONDS", "1.5")))
    _record(f"end {n} {os.getpid()}")
    return f"step {n} done"


@kit.tool
def stuck_step(n: int) -> str:
    """A synchronous tool blocked far longer than any grace (a blocking call without a timeout of its own)."""
    _record(f"start {n} {os.getpid()}")
    time.sleep(float(os.environ.get("TL_STUCK_SECONDS", "90")))
    return "too late"


def _tool_results(req: RecordedRequest) -> int:
    return sum(
        1
        for m in req.messages
        if m["role"] == "user"
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    )


def _script(req: RecordedRequest) -> Reply:
    """Step n (n = tool results seen + 1) calls slow_step(n) for n <= 3; then the model answers."""
    done = _tool_results(req)
    if done >= STEPS:
        return text_reply("all three steps done")
    return tool_reply([("slow_step", {"n": done + 1})])


async def _ready_task(client: Client, tool: str = "slow_step") -> str:
    gid = await client.submit("run three slow steps")
    spec = TaskSpec(id="t1", title="slow", instructions=f"call {tool} 1..3", definition_of_done="3 steps", tools=[tool])
    await client.store.transition_goal(gid, GoalState.PLANNING)
    await client.store.save_plan(gid, Plan(tasks=[spec]), expected_version=0)
    await client.store.transition_goal(gid, GoalState.RUNNING)
    await client.store.transition_task(gid, "t1", TaskState.READY, attempt=1)
    return gid


def _spawn(env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    out = log.open("w")
    return subprocess.Popen([*TASKLOOM, "worker", "executor"], env=env, stdout=out, stderr=subprocess.STDOUT)


def _lines(path: Path) -> list[tuple[str, int, int]]:
    """(event, step, pid) per line of the tool's record."""
    rows = []
    for line in path.read_text().splitlines():
        event, n, pid = line.split()
        rows.append((event, int(n), int(pid)))
    return rows


async def test_sigterm_mid_step_finishes_the_step_and_hands_the_rest_to_another_executor(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM during step 2: step 2 completes and is stored, the worker exits 0, a second executor
    resumes from step 3 well before the lease TTL, each tool ran once, no model turn was paid twice."""
    counter = tmp_path / "tool.txt"
    with FakeAnthropicServer() as fake:
        fake.respond_with(_script)
        env = fake_model_env(
            subprocess_env,
            fake.base_url,
            counter,
            TASKLOOM_TOOLS="test_shutdown:kit",
            # Long enough that a resume which waited for the lease to expire would fail the timing check.
            TASKLOOM_LEASE_TTL="60",
            TASKLOOM_SHUTDOWN_GRACE="20",
            TL_SLOW_SECONDS="1.5",
        )
        client = Client(redis, keys, default_budget_tokens=100_000)
        gid = await _ready_task(client)
        await client.jobs.enqueue(ExecuteJob(goal_id=gid, task_id="t1", attempt=1))
        attempt = AttemptStore(redis, keys, gid, "t1", 1)

        first = _spawn(env, tmp_path / "first.log")
        second = None
        try:

            async def started(n: int) -> bool:
                return counter.exists() and ("start", n) in {(e, s) for e, s, _ in _lines(counter)}

            await eventually(lambda: started(1), timeout=30)
            second = _spawn(env, tmp_path / "second.log")  # idle, ready to take the hand-over
            await eventually(lambda: started(2), timeout=30)
            first.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert first.wait(25) == 0, (tmp_path / "first.log").read_text()[-3000:]

            async def reviewing() -> bool:
                return (await client.store.get_task(gid, "t1")).state is TaskState.REVIEWING

            await eventually(reviewing, timeout=30)
            handed_over_in = time.monotonic() - signalled
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        requests = len(fake.message_requests)

    assert handed_over_in < 20, f"took {handed_over_in:.1f} s: the resume waited for the lease TTL"
    rows = _lines(counter)
    for n in range(1, STEPS + 1):  # every step's tool started once and finished once
        assert [e for e, s, _ in rows if s == n] == ["start", "end"], rows
    pids = {s: pid for e, s, pid in rows if e == "end"}
    assert pids[1] == pids[2] == first.pid and pids[3] == second.pid
    result = await client.store.get_result(gid, "t1", 1)
    assert result is not None and result.stop_reason == "answered" and result.steps == STEPS + 1
    assert [s.index for s in await attempt.steps()] == [0, 1, 2, 3]
    assert requests == STEPS + 1  # no model turn asked twice
    first_log = (tmp_path / "first.log").read_text()
    assert '"execute.handover"' in first_log and '"worker.stopped"' in first_log
    assert '"resumed_steps": 2' in (tmp_path / "second.log").read_text()


async def test_a_job_cancelled_at_the_end_of_the_grace_releases_its_lease_at_once(
    redis: ArqRedis, keys: Keys, tmp_path: Path, monkeypatch: Any
) -> None:
    """The grace ran out while a tool ran: the cancelled job gives its lease up (expired now, not
    after the TTL, and fenced so the old holder can no longer write), for another executor to resume."""
    monkeypatch.setenv("TL_COUNTER_FILE", str(tmp_path / "tool.txt"))
    monkeypatch.setenv("TL_SLOW_SECONDS", "30")

    with FakeAnthropicServer() as fake:
        fake.respond_with(_script)
        model = AnthropicModel("claude-test", api_key="sk-ant-test", base_url=fake.base_url)
        ledger = Ledger(redis, keys)
        rt = Runtime.build(redis, keys, models=ModelFactory(model, ledger), limits=Limits(lease_ttl=60))
        client = Client(redis, keys, default_budget_tokens=100_000)
        gid = await _ready_task(client)
        stopping = asyncio.Event()
        job = asyncio.create_task(
            execute(rt, ExecuteJob(goal_id=gid, task_id="t1", attempt=1), ToolRegistry([kit]), stopping.is_set)
        )

        async def tool_running() -> bool:
            path = tmp_path / "tool.txt"
            return path.exists() and "start 1" in path.read_text()

        await eventually(tool_running, timeout=15)
        lease = f"{keys.attempt(gid, 't1', 1)}:lease"
        epoch = int(await redis.hget(lease, "epoch"))
        stopping.set()
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        await model.aclose()

    assert int(await redis.hget(lease, "expires_ms")) == 0
    assert int(await redis.hget(lease, "epoch")) == epoch + 1  # the old holder is fenced off
    score = await redis.zscore(keys.leases(), keys.lease_member(gid, "t1", 1))
    assert score is not None and score <= time.time() * 1000  # expired: any watchdog resumes it now
    assert "end 1" not in (tmp_path / "tool.txt").read_text()  # the tool was stopped with its job
    resumed = AttemptStore(redis, keys, gid, "t1", 1)
    assert await resumed.acquire("another-executor", 60)  # not held: taken over at once


async def test_a_stuck_sync_tool_does_not_keep_the_worker_past_its_grace(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM while a sync tool blocks its thread for 90 s: the worker exits 0 soon after its 2 s grace,
    not when the thread returns (the thread is a daemon, abandoned at exit)."""
    counter = tmp_path / "tool.txt"
    with FakeAnthropicServer() as fake:
        fake.respond_with(lambda req: tool_reply([("stuck_step", {"n": 1})]))
        env = fake_model_env(
            subprocess_env,
            fake.base_url,
            counter,
            TASKLOOM_TOOLS="test_shutdown:kit",
            TASKLOOM_SHUTDOWN_GRACE="2",
            TASKLOOM_TOOL_TIMEOUT="300",
            TL_STUCK_SECONDS="90",
        )
        client = Client(redis, keys, default_budget_tokens=100_000)
        gid = await _ready_task(client, tool="stuck_step")
        await client.jobs.enqueue(ExecuteJob(goal_id=gid, task_id="t1", attempt=1))
        worker = _spawn(env, tmp_path / "worker.log")
        try:

            async def stuck() -> bool:
                return counter.exists() and "start 1" in counter.read_text()

            await eventually(stuck, timeout=60)
            worker.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            code = worker.wait(60)  # without the fix: ~90 s, the thread's sleep
            took = time.monotonic() - signalled
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    log = (tmp_path / "worker.log").read_text()
    assert code == 0, log[-3000:]
    assert took < 30, f"exit took {took:.1f} s after SIGTERM with a 2 s grace"
    assert '"worker.stopped"' in log
