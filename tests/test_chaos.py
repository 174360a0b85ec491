"""Crash recovery with real worker processes: a worker killed by SIGKILL in the middle of a job."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually, fake_model_env

from bus.client import Client
from bus.keys import Keys
from bus.ledger import Ledger
from bus.schemas import GoalState
from critic.prompts import REVIEW_SYSTEM
from llm import DemoModel
from llm.testing import FakeAnthropicServer, RecordedRequest, Script, content_text, responder_from_model

DEMO_GOAL = "Can orders A100 and A101 be refunded? Today is 2026-10-13."


def _spawn(role: str, env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    return subprocess.Popen([*TASKLOOM, "worker", role], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


async def _started(log: Path) -> None:
    """Wait until a worker process polls its queues (arq logs its start line)."""

    async def ready() -> bool:
        text = await asyncio.to_thread(lambda: log.read_text() if log.exists() else "")
        return "Starting worker" in text

    await eventually(ready, timeout=30, every=0.05)


def _is_review(req: RecordedRequest) -> bool:
    return content_text(req.body.get("system")) == REVIEW_SYSTEM


async def test_a_killed_critic_job_is_rerun_by_another_critic_within_the_lease(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGKILL a critic while its model call is in flight: another critic re-runs that review after
    the short job lease (not arq's 10-minute lock), and the goal still succeeds within its budget."""
    demo = responder_from_model(DemoModel(latency=0))
    verdicts = 0
    lock = threading.Lock()

    def respond(req: RecordedRequest) -> Script:
        nonlocal verdicts
        reply = demo(req)
        if _is_review(req):
            with lock:
                verdicts += 1
                first = verdicts == 1
            if first:  # the first review hangs long enough to be killed mid-call
                return dataclasses.replace(reply, delay=30.0)  # type: ignore[type-var]
        return reply

    budget = 200_000
    with FakeAnthropicServer() as fake:
        fake.respond_with(respond)
        env = fake_model_env(
            subprocess_env,
            fake.base_url,
            tmp_path / "counter.txt",
            TASKLOOM_TOOLS="executor.demo_tools:support",
            TASKLOOM_MODEL="claude-test",
            TASKLOOM_LEASE_TTL="3",
        )
        procs = {r: _spawn(r, env, tmp_path / f"{r}.log") for r in ("planner", "executor", "critic")}
        second = None
        try:
            client = Client(redis, keys, default_budget_tokens=budget)
            gid = await client.submit({"text": DEMO_GOAL, "budget_tokens": budget})

            async def first_review_in_flight() -> bool:
                return verdicts >= 1

            await eventually(first_review_in_flight, timeout=30)
            procs["critic"].send_signal(signal.SIGKILL)
            procs["critic"].wait(10)
            killed_at = time.monotonic()
            second = _spawn("critic", env, tmp_path / "critic2.log")

            async def succeeded() -> bool:
                return (await client.get(gid)).state is GoalState.SUCCEEDED

            await eventually(succeeded, timeout=45)
            assert time.monotonic() - killed_at < 30  # arq alone would wait its 610 s lock
        finally:
            for proc in [*procs.values(), second]:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert "job_try" in (tmp_path / "critic2.log").read_text()
        books = await Ledger(redis, keys).snapshot(gid)
        assert books.spent <= budget and fake.billed.total <= budget


async def test_random_sigkills_lose_no_goal_and_overspend_no_budget(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Two `worker all` processes, one SIGKILLed (and restarted) at random points four times while
    three goals run: every goal still succeeds, none spends over its budget, the books balance."""
    import random

    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    demo = responder_from_model(DemoModel(latency=0))

    def respond(req: RecordedRequest) -> Script:
        return dataclasses.replace(demo(req), delay=0.4)  # type: ignore[type-var]

    budget = 150_000
    with FakeAnthropicServer() as fake:
        fake.respond_with(respond)
        env = fake_model_env(
            subprocess_env,
            fake.base_url,
            tmp_path / "counter.txt",
            TASKLOOM_TOOLS="executor.demo_tools:support",
            TASKLOOM_LEASE_TTL="2",
            TASKLOOM_LEDGER_RESERVATION_TTL="4",
        )
        logs = [tmp_path / f"w{i}.log" for i in range(2)]
        procs = [_spawn("all", env, log) for log in logs]
        try:
            for log in logs:
                await _started(log)
            client = Client(redis, keys, default_budget_tokens=budget)
            gids = [
                await client.submit({"text": DEMO_GOAL.replace("A101", f"A10{i + 1}"), "budget_tokens": budget})
                for i in range(3)
            ]
            for n in range(4):
                await asyncio.sleep(rng.uniform(0.2, 1.2))  # somewhere in the middle of some job
                victim = rng.randrange(2)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait(10)
                logs[victim] = tmp_path / f"w{victim}-{n}.log"
                procs[victim] = _spawn("all", env, logs[victim])
                await _started(logs[victim])

            async def all_ended() -> bool:
                return all([(await client.get(g)).terminal for g in gids])

            await eventually(all_ended, timeout=90)
            states = {g: (await client.get(g)).state for g in gids}
            assert all(s is GoalState.SUCCEEDED for s in states.values()), f"seed {seed}: {states}"
            ledger = Ledger(redis, keys)

            async def settled() -> bool:
                await ledger.sweep()
                return all([(await ledger.snapshot(g)).reserved == 0 for g in gids])

            await eventually(settled, timeout=15, every=0.5)  # killed calls are forfeited on expiry
            for g in gids:
                books = await ledger.snapshot(g)
                assert books.spent <= budget, f"seed {seed}: {books}"
            assert fake.billed.total <= budget * len(gids)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
