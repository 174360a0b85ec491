"""Worker plumbing: arq workers per role on real Redis, in-process and as real processes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import structlog
from arq.connections import ArqRedis
from helpers import TASKLOOM, eventually

from bus.client import Client
from bus.jobs import PlanJob
from bus.keys import Keys
from bus.schemas import GoalState
from taskloom.settings import Settings
from taskloom.workers import run_workers, worker_settings


async def test_planner_worker_plans_a_submitted_goal_with_job_context_in_logs(
    redis: ArqRedis, keys: Keys, settings: Settings
) -> None:
    """A burst planner worker (demo model) plans the goal and dispatches; log lines carry goal/job ids."""
    client = Client(redis, keys, default_budget_tokens=100_000)
    gid = await client.submit("hello")
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await run_workers(["planner"], settings, burst=True)
    assert (await client.get(gid)).state is GoalState.RUNNING
    assert await redis.zcard(keys.queue("executor")) == 1
    claimed = [e for e in logs if e["event"] == "plan.claimed"]
    assert len(claimed) == 1
    assert claimed[0]["goal_id"] == gid and claimed[0]["role"] == "planner"
    assert claimed[0]["job_id"] == client.jobs.job_id(PlanJob(goal_id=gid))


async def test_a_job_with_an_invalid_payload_is_dropped_with_a_clear_log(
    redis: ArqRedis, keys: Keys, settings: Settings
) -> None:
    """A payload that fails validation is logged naming the field and does not crash the worker."""
    # Job ids under the test's prefix, so that the fixture's cleanup deletes arq's result keys too.
    queue = keys.queue("planner")
    await redis.enqueue_job("plan", {"goal_id": "not a valid id!"}, _queue_name=queue, _job_id=f"{keys.prefix}bad-1")
    await redis.enqueue_job("plan", {"goal": "x"}, _queue_name=queue, _job_id=f"{keys.prefix}bad-2")
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        await run_workers(["planner"], settings, burst=True)
    bad = [e for e in logs if e["event"] == "job.invalid_payload"]
    assert len(bad) == 2
    assert {str(err["loc"][0]) for e in bad for err in e["errors"]} >= {"goal_id", "goal"}


def test_worker_settings_put_each_role_on_its_own_queue(settings: Settings) -> None:
    """planner, executor and critic listen on three distinct prefixed queues with our poll delay."""
    queues = {worker_settings(r, settings)["queue_name"] for r in ("planner", "executor", "critic")}
    assert len(queues) == 3 and all(q.startswith(settings.key_prefix) for q in queues)
    assert worker_settings("executor", settings)["poll_delay"] == settings.poll_delay


async def _exited(proc: subprocess.Popen[str]) -> bool:
    return proc.poll() is not None


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_worker_process_runs_jobs_and_stops_cleanly_on_sigterm(
    redis: ArqRedis, keys: Keys, subprocess_env: dict[str, str], tmp_path: Path, loop: str
) -> None:
    """`taskloom worker all` takes a goal to its end (demo model), heartbeats, and exits 0 on SIGTERM,
    on either event loop (TASKLOOM_EVENT_LOOP), and says in `worker.started` which one it runs."""
    out = (tmp_path / "worker.log").open("w+")
    env = dict(subprocess_env, TASKLOOM_EVENT_LOOP=loop)
    # Its output goes to a file, not a pipe, so the child can never block on a full pipe.
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting the child is instant; it runs on its own
        [*TASKLOOM, "worker", "all"], env=env, stdout=out, stderr=subprocess.STDOUT, text=True
    )
    try:
        client = Client(redis, keys, default_budget_tokens=100_000)
        gid = await client.submit("hello")

        async def ended() -> bool:
            return (await client.get(gid)).state is GoalState.SUCCEEDED

        await eventually(ended, timeout=30)

        async def heartbeat() -> bool:
            return bool(await redis.exists(keys.health_check("executor")))

        await eventually(heartbeat, timeout=10)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        await eventually(lambda: _exited(proc), timeout=30)
        out.seek(0)
        stdout = out.read()
        assert proc.returncode == 0, stdout[-2000:]
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
    events = [x["event"] for x in lines]
    assert "worker.started" in events and "worker.stopped" in events
    assert [x["event_loop"] for x in lines if x["event"] == "worker.started"] == [loop]
    assert any(x.get("goal_id") == gid and x["event"] == "plan.claimed" for x in lines)
    assert not await redis.exists(keys.health_check("executor"))


async def _claim_latency(redis: ArqRedis, keys: Keys, settings: Settings) -> float:
    """Seconds from submitting a goal to the planner claiming it, with an idle planner already polling."""
    stop = asyncio.Event()
    worker = asyncio.create_task(run_workers(["planner"], settings, stop=stop))
    try:
        await asyncio.sleep(0.5)  # the worker has made its first poll and is idle now
        client = Client(redis, keys, default_budget_tokens=100_000)
        started = time.monotonic()
        gid = await client.submit("hello")

        async def claimed() -> bool:
            return (await client.get(gid)).state is not GoalState.SUBMITTED

        await eventually(claimed, timeout=8, every=0.01)
        return time.monotonic() - started
    finally:
        stop.set()
        await worker


async def test_an_enqueue_wakes_an_idle_worker_long_before_its_poll(
    redis: ArqRedis, keys: Keys, settings: Settings
) -> None:
    """With a 5 s fallback poll, a new job still starts at once: the enqueue wakes the worker."""
    woken = await _claim_latency(redis, keys, settings.model_copy(update={"poll_delay": 5.0, "wake": True}))
    assert woken < 1.0


async def test_without_wake_ups_the_poll_delay_is_the_wait(redis: ArqRedis, keys: Keys, settings: Settings) -> None:
    """The control: wake-ups off, the same job waits for the 3 s poll (so the test above measures the wake-up)."""
    polled = await _claim_latency(redis, keys, settings.model_copy(update={"poll_delay": 3.0, "wake": False}))
    assert polled > 1.0
