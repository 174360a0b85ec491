"""The failover suite: 30 goals, each with a side-effecting step, on a primary, a replica and three
Sentinels (real `redis-server` processes, tests/sentinel.py), while the master changes under them.

Workers of every role (planner, 2 executors, critic) run as processes with a `redis+sentinel://` URL
and `TASKLOOM_REDIS_WAIT_REPLICAS=1`; the model is the fake Messages API. Mid-run, when at least 10
goals are running, the master changes: by `SENTINEL FAILOVER` (`failover`), or by SIGKILLing it
(`kill`; Sentinel promotes the replica after `down-after-milliseconds`, and the killed node is
restarted from its AOF, so that Sentinel turns it into the new master's replica).

Checks: every goal ends and succeeds; no side effect ran twice, judged from the tool's own log; no
goal was billed past its budget by the fake server's count; no worker exited. The run prints how
many repairs the supervisor made (dispatches and moves the failover lost).

Not covered here yet: full memory and a cut connection (issue 31, items 3-5).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import TASKLOOM, eventually, fake_model_env
from sentinel import SentinelCluster
from test_e2e import Scenario, role_of, spec, task_of

from bus.client import Client
from bus.connection import connect
from bus.keys import Keys
from bus.schemas import GoalState
from llm.testing import FakeAnthropicServer, RecordedRequest, Reply, Script

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

GOALS = 30
BUDGET = 60_000
REPLY_DELAY = 0.3
ROLES = ("planner", "executor", "executor", "critic")
GOAL_TAG = re.compile(r"failover goal (G\d\d)")


def goal_of(req: RecordedRequest) -> str | None:
    m = GOAL_TAG.search(str(req.body.get("messages")))
    return m.group(1) if m else None


@dataclasses.dataclass
class Responder:
    scenario: Scenario

    def __call__(self, req: RecordedRequest) -> Script:
        tag = goal_of(req)
        number = int(tag[1:]) if tag else 0
        if role_of(req) == "executor" and task_of(req) == "pay":
            reply = Scenario(plans={}, calls={"pay": [("charge", {"amount": number})]})(req)
        else:
            reply = self.scenario(req)
        return dataclasses.replace(reply, delay=REPLY_DELAY) if isinstance(reply, Reply) else reply


def _spawn(role: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen([*TASKLOOM, "worker", role], env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("how", ["failover", "kill"])
async def test_goals_survive_a_master_change_with_no_side_effect_twice(how: str, tmp_path: Path) -> None:
    """See the module docstring."""
    prefix = "failover:"
    keys = Keys(prefix=prefix)
    counter = tmp_path / "tool-log.txt"
    dag = [spec("look"), spec("pay", deps=("look",), tools=("charge",)), spec("sum", deps=("pay",))]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    with SentinelCluster(tmp_path / "cluster") as cluster, FakeAnthropicServer(bill_key=goal_of) as fake:
        fake.respond_with(Responder(Scenario(plans={0: [{"tasks": dag}]})))
        base = {"TASKLOOM_REDIS_URL": cluster.url, "TASKLOOM_KEY_PREFIX": prefix, "PYTHONUNBUFFERED": "1"}
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "TASKLOOM_"))}
        env = fake_model_env(
            {**base_env, **base},
            fake.base_url,
            counter,
            TASKLOOM_HOME=str(tmp_path / "home"),
            TASKLOOM_POLL_DELAY="0.2",
            TASKLOOM_LEASE_TTL="3",
            TASKLOOM_RECONCILE_AFTER="5",
            TASKLOOM_PROVIDER_BACKOFF_MAX="2",
            TASKLOOM_LEDGER_RESERVATION_TTL="20",
            TASKLOOM_REDIS_WAIT_REPLICAS="1",
            TASKLOOM_REDIS_WAIT_TIMEOUT="0.5",
        )
        procs.extend(_spawn(role, env, logs / f"{i}-{role}.log") for i, role in enumerate(ROLES))
        try:

            async def fleet_ready() -> bool:
                return all("Starting worker" in p.read_text() for p in logs.glob("*.log"))

            await eventually(fleet_ready, timeout=60, every=0.2)
            async with connect(cluster.url, tmp_path / "home") as pool:
                client = Client(pool, keys, default_budget_tokens=BUDGET)
                gids = [
                    await client.submit({"text": f"failover goal G{i:02d}: pay it", "budget_tokens": BUDGET})
                    for i in range(GOALS)
                ]
                started = time.monotonic()

                async def states() -> Counter[str]:
                    out: Counter[str] = Counter()
                    for g in gids:
                        try:
                            raw = await pool.hget(keys.goal(g), "state")
                        except Exception:  # the test's own pool meets the master change too
                            raw = None
                        out[raw.decode() if raw else "?"] += 1
                    return out

                async def running() -> bool:
                    return (await states())["running"] >= 10

                await eventually(running, timeout=60, every=0.2)
                old = cluster.master_port()
                if how == "failover":
                    await asyncio.to_thread(cluster.failover)
                else:
                    cluster.kill(old)
                    await eventually(lambda: asyncio.to_thread(lambda: cluster.master_port() != old), timeout=30)
                    await asyncio.to_thread(cluster.restart, old)
                changed = time.monotonic() - started

                async def all_ended() -> bool:
                    return sum(n for s, n in (await states()).items() if s in ("succeeded", "failed")) == GOALS

                await eventually(all_ended, timeout=150, every=1.0)
                records = {g: await client.get(g) for g in gids}
            failed = {g: (r.state.value, r.reason) for g, r in records.items() if r.state is not GoalState.SUCCEEDED}
            assert not failed, failed
            lines = [line.split() for line in counter.read_text().splitlines() if line.startswith("charge ")]
            per_call = Counter(parts[2] for parts in lines)
            assert all(n == 1 for n in per_call.values()), f"repeated side effects: {per_call.most_common(3)}"
            per_goal = Counter(key.split(":")[0] for key in per_call)
            assert all(n == 1 for n in per_goal.values())
            for i in range(GOALS):
                assert fake.billed_for(f"G{i:02d}").total <= BUDGET
            exited = [p.args for p in procs if p.poll() is not None]
            assert not exited, exited
            text = "".join(p.read_text() for p in logs.glob("*.log"))
            assert "redis.master_changed" in text
            print(
                f"{how}: master changed {changed:.1f} s in, {len(per_goal)} charges for {GOALS} goals, "
                f"{text.count('supervisor.redrive')} supervisor repairs, {text.count('lease_lost')} lost leases, "
                f"{text.count('NotReplicated')} unconfirmed writes, {time.monotonic() - started:.0f} s"
            )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
