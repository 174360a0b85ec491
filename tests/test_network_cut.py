"""A network cut between one executor and Redis (not a Redis restart): its connections are reset
and refused through a TCP proxy while it holds a task; another executor takes the task over once the
lease expires, and when the first one is back it runs nothing twice."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TASKLOOM, eventually, fake_model_env
from sentinel import SentinelCluster
from tcpproxy import TcpProxy
from test_e2e import Scenario, role_of, spec, task_of

from bus.client import Client
from bus.connection import connect
from bus.keys import Keys
from bus.schemas import GoalState
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, Script

pytestmark = pytest.mark.chaos

CUT_FOR = 12.0  # seconds: well past the lease (3 s), so that another executor takes over meanwhile


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SentinelCluster]:
    with SentinelCluster(tmp_path / "redis", replicas=0, sentinels=0) as s:
        yield s


def _spawn(role: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen([*TASKLOOM, "worker", role], env=env, stdout=out, stderr=subprocess.STDOUT)


async def test_an_executor_cut_off_from_redis_runs_nothing_twice_once_back(
    server: SentinelCluster, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """Executor A's connections are reset while the model answers its side-effecting turn; B takes
    the task over after the lease and charges while A is still cut off; A, reconnected 12 s after
    the cut, finds its lease gone: the charge ran once (the tool's own log), the goal succeeds,
    and no worker exited."""
    keys = Keys(prefix="cut:")
    counter = tmp_path / "tool-log.txt"
    scenario = Scenario(
        plans={0: [{"tasks": [spec("pay", tools=("charge",)), spec("sum", deps=("pay",))]}]},
        calls={"pay": [("charge", {"amount": 7})]},
    )
    cut_at: list[float] = []
    lock = threading.Lock()
    with TcpProxy(server.data_ports[0]) as proxy, FakeAnthropicServer() as fake:

        def respond(req: RecordedRequest) -> Script:
            reply = scenario(req)
            with lock:
                first = role_of(req) == "executor" and task_of(req) == "pay" and not cut_at
                if first:
                    cut_at.append(time.monotonic())
            if first:
                proxy.cut()  # executor A (the only one yet) is cut off while its model call runs
                assert isinstance(reply, Reply)
                return dataclasses.replace(reply, delay=1.0)
            return reply

        fake.respond_with(respond)
        direct = dict(subprocess_env, TASKLOOM_REDIS_URL=server.primary_url, TASKLOOM_KEY_PREFIX=keys.prefix)
        env = fake_model_env(
            direct, fake.base_url, counter, TASKLOOM_LEASE_TTL="3", TASKLOOM_RECONCILE_AFTER="5"
        )
        cut_env = dict(env, TASKLOOM_REDIS_URL=f"redis://127.0.0.1:{proxy.port}/0")
        logs = {name: tmp_path / f"{name}.log" for name in ("planner", "critic", "a", "b")}
        procs = {
            "planner": _spawn("planner", env, logs["planner"]),
            "critic": _spawn("critic", env, logs["critic"]),
            "a": _spawn("executor", cut_env, logs["a"]),
            "b": _spawn("executor", env, logs["b"]),
        }
        try:

            async def ready() -> bool:
                return all("Starting worker" in logs[n].read_text() for n in procs)

            await eventually(ready, timeout=60, every=0.1)
            # B is frozen until A is cut off, so that A is the executor that starts the task.
            procs["b"].send_signal(signal.SIGSTOP)
            async with connect(server.primary_url, tmp_path / "home") as redis:
                client = Client(redis, keys, default_budget_tokens=100_000)
                gid = await client.submit({"text": "pay it", "budget_tokens": 100_000})

                async def cut() -> bool:
                    return bool(cut_at)

                await eventually(cut, timeout=30)
                procs["b"].send_signal(signal.SIGCONT)

                async def charged() -> bool:
                    return "charge " in (counter.read_text() if counter.exists() else "")

                # B takes the task over once A's lease expires, while A is still cut off.
                await eventually(charged, timeout=CUT_FOR - 1)
                await asyncio.sleep(max(0.0, cut_at[0] + CUT_FOR - time.monotonic()))
                proxy.heal()
                record = await client.wait(gid, timeout=60)
                assert record.state is GoalState.SUCCEEDED, record
                await asyncio.sleep(2)  # A's late writes, if any, have landed
            charges = [line for line in counter.read_text().splitlines() if line.startswith("charge ")]
            assert len(charges) == 1, charges
            assert "charge" in logs["b"].read_text()  # B ran the task A had started
            a_log = logs["a"].read_text()
            assert "poll_failed" in a_log or "job.retry" in a_log  # A saw the cut, and carried on
            exited = [n for n, p in procs.items() if p.poll() is not None]
            assert not exited, exited
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                p.wait(10)
