"""A real fleet on Sentinel: `taskloom worker all` with a `redis+sentinel://` URL rides out a
`SENTINEL FAILOVER` in the middle of a goal, and the goal succeeds."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import TASKLOOM, eventually, fake_model_env
from sentinel import SentinelCluster

from bus.client import Client
from bus.connection import connect
from bus.keys import Keys
from bus.ledger import Ledger
from bus.schemas import GoalState
from llm import DemoModel
from llm.testing import FakeAnthropicServer, RecordedRequest, Script, responder_from_model

pytestmark = pytest.mark.chaos

DEMO_GOAL = "Can orders A100 and A101 be refunded? Today is 2026-10-13."


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    with SentinelCluster(tmp_path / "cluster") as c:
        yield c


async def _started(log: Path) -> None:
    async def ready() -> bool:
        text = await asyncio.to_thread(lambda: log.read_text() if log.exists() else "")
        return "Starting worker" in text

    await eventually(ready, timeout=30, every=0.05)


async def test_worker_all_on_sentinel_survives_a_failover_mid_goal(
    cluster: SentinelCluster, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """SENTINEL FAILOVER while the demo goal's tasks run: the worker follows the new master (it
    logs redis.master_changed and never exits), the goal succeeds on the new master, and the old
    master, demoted and resynced, holds the same outcome."""
    demo = responder_from_model(DemoModel(latency=0))
    calls = 0

    def respond(req: RecordedRequest) -> Script:
        nonlocal calls
        calls += 1
        return dataclasses.replace(demo(req), delay=0.4)  # type: ignore[type-var]

    budget = 200_000
    keys = Keys(prefix=subprocess_env["TASKLOOM_KEY_PREFIX"])
    log = tmp_path / "worker.log"
    with FakeAnthropicServer() as fake:
        fake.respond_with(respond)
        env = fake_model_env(
            dict(subprocess_env, TASKLOOM_REDIS_URL=cluster.url),
            fake.base_url,
            tmp_path / "counter.txt",
            TASKLOOM_TOOLS="executor.demo_tools:support",
            # A dispatch the failover lost is repaired by the supervisor after this long (default 20 s).
            TASKLOOM_RECONCILE_AFTER="5",
        )
        proc: subprocess.Popen[Any] = subprocess.Popen(  # noqa: ASYNC220 (started once, never waited on here)
            [*TASKLOOM, "worker", "all"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        try:
            await _started(log)
            async with connect(cluster.url, tmp_path / "home") as redis:
                client = Client(redis, keys, default_budget_tokens=budget)
                gid = await client.submit({"text": DEMO_GOAL, "budget_tokens": budget})

                async def tasks_running() -> bool:
                    return calls >= 2  # the plan is made, the executors are on their tasks

                await eventually(tasks_running, timeout=30)
                old, new = await asyncio.to_thread(cluster.failover)

                async def ended() -> bool:
                    try:
                        return (await client.get(gid)).terminal
                    except Exception:  # the test's own pool meets the failover too
                        return False

                await eventually(ended, timeout=45, every=0.2)
                record = await client.get(gid)
                assert record.state is GoalState.SUCCEEDED, record
                books = await Ledger(redis, keys).snapshot(gid)
            assert proc.poll() is None, "the worker exited"
            text = log.read_text()
            assert "redis.master_changed" in text and f"127.0.0.1:{new}" in text
            assert books.spent <= budget and fake.billed.total <= budget
            # Demoted and resynced, the old master holds what the new one decided.
            await asyncio.to_thread(cluster.wait_demoted, old)
            state = cluster.client(old).hget(keys.goal(gid), "state")
            assert state is not None and b"succeeded" in state
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
