"""`taskloom health` and the per-process worker heartbeats it reads."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually, run_cli

from bus import fleet
from bus.keys import Keys
from taskloom import health
from taskloom.settings import Settings
from taskloom.workers import run_workers


async def test_health_tells_a_live_worker_from_a_killed_one(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """No worker: exit 1 naming the role; a running executor: exit 0 (also --local, --json); the
    same worker killed with SIGKILL: exit 1 once its heartbeat went stale, saying so."""
    env = dict(subprocess_env, TASKLOOM_HEARTBEAT_TTL="1.5")
    before = await asyncio.to_thread(run_cli, "health", "--role", "executor", env=env)
    assert before.returncode == 1 and "no live executor worker" in before.stderr

    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting the child is instant; it runs on its own
        [*TASKLOOM, "worker", "executor"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:

        async def live() -> bool:
            return (await health.check(redis, keys, ["executor"])).ok

        await eventually(live, timeout=30)
        ok = await asyncio.to_thread(run_cli, "health", "--role", "executor", "--local", "--json", env=env)
        assert ok.returncode == 0, ok.stderr
        body = json.loads(ok.stdout)
        assert body["ok"] and body["roles"]["executor"]["live"] == [f"{socket.gethostname()}:{proc.pid}"]
        planner = await asyncio.to_thread(run_cli, "health", "--role", "planner", env=env)
        assert planner.returncode == 1 and "no live planner worker" in planner.stderr

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

        async def dead() -> bool:
            return not await live()

        await eventually(dead, timeout=10)
        after = await asyncio.to_thread(run_cli, "health", "--role", "executor", env=env)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert after.returncode == 1
    assert "no live executor worker" in after.stderr and f":{proc.pid} went stale" in after.stderr


def test_health_fails_with_the_reason_when_redis_is_unreachable(subprocess_env: dict[str, str]) -> None:
    """Nothing listens at TASKLOOM_REDIS_URL: exit 1, and the message says Redis cannot be reached."""
    env = dict(subprocess_env, TASKLOOM_REDIS_URL="redis://127.0.0.1:1/0")
    result = run_cli("health", "--role", "critic", "--timeout", "2", env=env)
    assert result.returncode == 1 and "cannot reach Redis" in result.stderr


async def test_a_worker_stopped_cleanly_leaves_no_heartbeat(redis: ArqRedis, keys: Keys, settings: Settings) -> None:
    """A worker stopped by its stop signal removes its heartbeat at once (no stale-dead entry)."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_workers(["critic"], settings, stop=stop))

    async def live() -> bool:
        return (await health.check(redis, keys, ["critic"])).ok

    await eventually(live, timeout=10)
    stop.set()
    await asyncio.wait_for(task, 15)
    report = await health.check(redis, keys, ["critic"])
    assert not report.ok and report.roles["critic"] == []


async def test_local_only_counts_this_hosts_workers(redis: ArqRedis, keys: Keys) -> None:
    """A container probe (--local) is not fooled by a live worker of the same role on another host."""
    await fleet.beat(redis, keys, ["executor"], "another-pod:1", ttl=30)
    assert (await health.check(redis, keys, ["executor"])).ok
    local = await health.check(redis, keys, ["executor"], host=socket.gethostname())
    assert not local.ok and local.reasons == [f"no live executor worker on host {socket.gethostname()}"]


@pytest.mark.parametrize("threshold", [50_000, 0])
async def test_a_running_fleet_keeps_its_startup_objects_out_of_the_collector(
    settings: Settings, threshold: int
) -> None:
    """While a fleet runs, what it built at startup is frozen (a full collection does not scan
    it, so it does not pause the jobs for long) and the young generation is collected every
    `gc_threshold` new objects (0: Python's own thresholds stay); once stopped, both are undone."""
    assert gc.get_freeze_count() == 0
    before = gc.get_threshold()
    stop = asyncio.Event()
    configured = settings.model_copy(update={"gc_threshold": threshold})
    task = asyncio.create_task(run_workers(["critic"], configured, stop=stop))

    async def frozen() -> bool:
        return gc.get_freeze_count() > 0

    await eventually(frozen, timeout=10)
    assert gc.get_threshold() == ((threshold, *before[1:]) if threshold else before)
    stop.set()
    await asyncio.wait_for(task, 15)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
