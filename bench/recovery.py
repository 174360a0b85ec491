"""Recovery times, each beside the lease TTL they depend on.

    python -m bench.recovery [--redis-url redis://127.0.0.1:6379/0] [--lease-ttl 15] [--kills 3]
                             [--outage 30] [--backoff-max 30]

Real worker processes (planner, critic, two executors) against the fake Messages API (answering
each call after 0.1 s). Keys live under a unique prefix and are deleted afterwards; without a
reachable `--redis-url` an embedded redis-server is used.

1. Kill to next step: a goal's only task takes many steps; the executor running it is SIGKILLed
   right after it stored a step. Measured: from the SIGKILL to the next step of that task being
   stored by the other executor (it resumes the attempt after the lease expires). Repeated
   `--kills` times (the killed executor is restarted each time).
2. Outage to finish: goals are running when every model request starts failing with 529 for
   `--outage` seconds. Measured: from the end of the outage to each goal succeeding. The jobs wait
   with exponential backoff capped at `--backoff-max` (TASKLOOM_PROVIDER_BACKOFF_MAX), so this is
   bounded by that cap plus the remaining work.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import threading
import time
from pathlib import Path

from bench._harness import DEFAULT_REDIS, Bench, Responder, bench_redis, goal_text, spawn_worker, stop, worker_env
from bus.client import Client
from bus.schemas import GoalState, TaskState
from llm.testing import FakeAnthropicServer, RecordedRequest, Script, overloaded


class Outage:
    """The bench's responder, failing every request with 529 while `on` is set."""

    def __init__(self, inner: Responder) -> None:
        self.inner = inner
        self.on = threading.Event()

    def __call__(self, req: RecordedRequest) -> Script:
        return overloaded() if self.on.is_set() else self.inner(req)


async def _until(check: object, timeout: float, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():  # type: ignore[operator]
            return
        await asyncio.sleep(every)
    raise TimeoutError(f"not reached within {timeout} s")


async def kill_to_next_step(bench: Bench, env: dict[str, str], logs: Path, kills: int) -> list[float]:
    client = Client(bench.redis, bench.keys, default_budget_tokens=5_000_000)
    procs = {
        "planner": spawn_worker("planner", env, logs / "planner.log"),
        "critic": spawn_worker("critic", env, logs / "critic.log"),
    }
    executors = [spawn_worker("executor", env, logs / f"executor-{i}.log") for i in range(2)]
    times: list[float] = []
    try:
        gid = await client.submit(goal_text(1, 1, 60 * kills))  # one task, many steps
        task_id = "c0-t0"

        async def running() -> bool:
            tasks = await client.store.get_tasks(gid)
            return task_id in tasks and tasks[task_id].state is TaskState.RUNNING

        await _until(running, 60)
        attempt = (await client.store.get_task(gid, task_id)).attempt
        base = bench.keys.attempt(gid, task_id, attempt)
        for n in range(kills):
            steps_before = await bench.redis.llen(f"{base}:steps")

            async def stepped(before: int = steps_before) -> bool:
                return int(await bench.redis.llen(f"{base}:steps")) > before

            await _until(stepped, 30)  # kill right after a step was stored
            holder = (await bench.redis.hget(f"{base}:lease", "holder") or b"").decode()
            pid = int(holder.split(":")[1]) if holder.count(":") >= 2 else 0
            victim = next((i for i, p in enumerate(executors) if p.pid == pid), None)
            if victim is None:
                continue
            steps_at_kill = await bench.redis.llen(f"{base}:steps")
            executors[victim].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            executors[victim].wait()

            async def resumed(at: int = steps_at_kill) -> bool:
                return int(await bench.redis.llen(f"{base}:steps")) > at

            await _until(resumed, 120)
            times.append(time.monotonic() - killed)
            executors[victim] = spawn_worker("executor", env, logs / f"executor-{victim}-{n}.log")
            await asyncio.sleep(1.0)
        await client.cancel(gid)
    finally:
        stop([*procs.values(), *executors])
    return times


async def outage_to_finish(
    bench: Bench, env: dict[str, str], logs: Path, outage: Outage, seconds: float, goals: int
) -> list[float]:
    client = Client(bench.redis, bench.keys, default_budget_tokens=5_000_000)
    procs = [
        spawn_worker(r, env, logs / f"o-{r}-{i}.log")
        for i, r in enumerate(("planner", "critic", "executor", "executor"))
    ]
    try:
        gids = [await client.submit(goal_text(2, 2, 3) + f" #{i}") for i in range(goals)]

        async def all_running() -> bool:
            return all([(await client.get(g)).state is GoalState.RUNNING for g in gids])

        await _until(all_running, 60)
        outage.on.set()
        await asyncio.sleep(seconds)
        outage.on.clear()
        ended = time.monotonic()
        done: dict[str, float] = {}

        async def finished() -> bool:
            for g in gids:
                if g not in done and (await client.get(g)).terminal:
                    done[g] = time.monotonic() - ended
            return len(done) == len(gids)

        await _until(finished, seconds + 300, every=0.05)
        states = {(await client.get(g)).state for g in gids}
        if states != {GoalState.SUCCEEDED}:
            raise RuntimeError(f"goals did not all succeed: {states}")
        return list(done.values())
    finally:
        stop(procs)


def _row(name: str, values: list[float], ttl: str) -> str:
    if not values:
        return f"| {name} | 0 | - | - | - | {ttl} |"
    return (
        f"| {name} | {len(values)} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | {ttl} |"
    )


async def run(url: str, lease_ttl: float, kills: int, outage_s: float, backoff_max: float, goals: int) -> str:
    async with bench_redis(url, "recovery") as bench:
        responder = Outage(Responder(delay=0.1))
        with FakeAnthropicServer() as fake:
            fake.respond_with(responder)
            env = worker_env(
                bench,
                poll_delay=0.5,
                base_url=fake.base_url,
                TASKLOOM_LEASE_TTL=str(lease_ttl),
                TASKLOOM_PROVIDER_BACKOFF_MAX=str(backoff_max),
                TASKLOOM_MODEL_MAX_RETRIES="2",
                TASKLOOM_MAX_STEPS="1000",
            )
            logs = bench.home / "logs"
            logs.mkdir()
            kill_times = await kill_to_next_step(bench, env, logs, kills)
            finish_times = await outage_to_finish(bench, env, logs, responder, outage_s, goals)
    return "\n".join(
        [
            f"Redis: {bench.where}; lease TTL {lease_ttl:g} s; outage {outage_s:g} s; backoff cap {backoff_max:g} s",
            "",
            "| measure | n | median s | min s | max s | beside |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
            _row(
                "SIGKILL of the executor -> next step of its task stored by another",
                kill_times,
                f"lease TTL {lease_ttl:g} s",
            ),
            _row(
                "end of the outage -> goal succeeded",
                finish_times,
                f"lease TTL {lease_ttl:g} s, backoff cap {backoff_max:g} s",
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--lease-ttl", type=float, default=15.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--outage", type=float, default=30.0)
    parser.add_argument("--backoff-max", type=float, default=30.0)
    parser.add_argument("--goals", type=int, default=3)
    args = parser.parse_args()
    print(asyncio.run(run(args.redis_url, args.lease_ttl, args.kills, args.outage, args.backoff_max, args.goals)))


if __name__ == "__main__":
    main()
