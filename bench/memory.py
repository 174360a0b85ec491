"""Memory: peak RSS of one executor process holding `--tasks` concurrent tasks that all wait on a slow
model, beside the same process idle and a raw arq worker process idle.

    python -m bench.memory [--redis-url redis://127.0.0.1:6379/0] [--tasks 200] [--delay 5]

One `taskloom worker executor` process with `TASKLOOM_EXECUTOR_CONCURRENCY=--tasks`; `--tasks`
goals of one task each (a tool call, then an answer) are stored and their execute jobs enqueued;
the fake Messages API (in this process) answers every call after `--delay` s. RSS is read from
/proc/<pid>/status: VmRSS when the process is idle (before any job), then VmHWM (the peak) and
VmRSS once every task's first model call has reached the fake server and is waiting, and VmHWM
again once their second calls (after the tool step) wait. Keys live under a unique prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from bench._harness import (
    DEFAULT_REDIS,
    Responder,
    bench_redis,
    goal_text,
    machine,
    profile_from_now,
    profile_until_now,
    spawn,
    spawn_worker,
    stop,
    wait_for_keys,
    worker_env,
)
from bus.client import Client
from bus.jobs import ExecuteJob
from bus.schemas import GoalState, Plan, TaskSpec, TaskState
from llm.testing import FakeAnthropicServer


def status_kb(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, ... in kB, and Threads, from /proc/<pid>/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.startswith("Vm") or name == "Threads":
            out[name] = int(value.split()[0])
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def prepare(client: Client, n: int) -> list[ExecuteJob]:
    """`n` running goals with one ready task each (as the planner would leave them); their jobs."""
    spec = TaskSpec(
        id="c0-t0",
        title="fetch",
        instructions="Fetch record 0 and report it.",
        definition_of_done="reported",
        tools=["fetch"],
    )
    jobs = []
    for _ in range(n):
        gid = await client.submit(goal_text(1, 1, 1))
        await client.store.transition_goal(gid, GoalState.PLANNING)
        await client.store.save_plan(gid, Plan(tasks=[spec]), expected_version=0)
        await client.store.transition_goal(gid, GoalState.RUNNING)
        await client.store.transition_task(gid, spec.id, TaskState.READY, attempt=1)
        jobs.append(ExecuteJob(goal_id=gid, task_id=spec.id, attempt=1))
    return jobs


async def run(url: str, tasks: int, delay: float) -> str:
    async with bench_redis(url, "memory") as bench:
        where = await machine(bench.redis, bench.where)
        with FakeAnthropicServer() as fake:
            fake.respond_with(Responder(delay=delay))
            env = worker_env(bench, poll_delay=0.05, base_url=fake.base_url, TASKLOOM_EXECUTOR_CONCURRENCY=str(tasks))
            proc = spawn_worker("executor", env, bench.home / "executor.log")
            arq = None
            try:
                await wait_for_keys(bench.redis, [bench.keys.health_check("executor")], [proc])
                client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
                jobs = await prepare(client, tasks)
                await asyncio.sleep(2.0)
                idle = status_kb(proc.pid)
                profile_from_now([proc])
                cpu0, own0 = cpu_s(proc.pid), time.process_time()
                t0, m0 = time.perf_counter(), time.monotonic()
                for job in jobs:
                    await client.jobs.enqueue(job)
                t_enqueued = time.perf_counter() - t0
                waiting = await wait_requests(fake, tasks, 60)
                t_first = time.perf_counter() - t0
                arrivals = sorted(r.at - m0 for r in fake.message_requests if len(r.messages) == 1)  # first calls
                cpu_first = cpu_s(proc.pid) - cpu0
                own_first = time.process_time() - own0  # this process: the enqueues and the fake server
                profile_until_now([proc])
                await asyncio.sleep(min(1.0, delay / 4))
                loaded = status_kb(proc.pid)
                await wait_requests(fake, 2 * tasks, 60 + 2 * delay)
                await asyncio.sleep(min(1.0, delay / 4))
                second = status_kb(proc.pid)
                queue = f"{bench.prefix}arq-idle"
                args = ["-m", "bench._harness", "noop", "--redis-url", bench.url, "--queue", queue]
                arq = spawn(args, env, bench.home / "arq.log")
                await wait_for_keys(bench.redis, [f"{queue}:health-check"], [arq])
                await asyncio.sleep(1.0)
                arq_idle = status_kb(arq.pid)
            finally:
                stop([proc, arq])
    window = (t_first, cpu_first, t_enqueued, own_first)
    return report(where, tasks, delay, idle, loaded, second, arq_idle, waiting, *window, arrivals)


async def wait_requests(fake: FakeAnthropicServer, n: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while len(fake.message_requests) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(fake.message_requests)} of {n} model calls reached the fake server")
        await asyncio.sleep(0.05)
    return len(fake.message_requests)


def report(
    where: str,
    tasks: int,
    delay: float,
    idle: dict[str, int],
    loaded: dict[str, int],
    second: dict[str, int],
    arq_idle: dict[str, int],
    waiting: int,
    t_first: float,
    cpu_first: float,
    t_enqueued: float,
    own_first: float,
    arrivals: list[float],
) -> str:
    def mb(kb: int) -> str:
        return f"{kb / 1024:.1f}"

    peak = max(loaded["VmHWM"], second["VmHWM"])
    per_task = (peak - idle["VmRSS"]) / tasks
    return "\n".join(
        [
            where,
            f"{tasks} tasks in one executor process (TASKLOOM_EXECUTOR_CONCURRENCY={tasks}), every model call "
            f"answered after {delay:g} s; all {waiting} first calls in flight {t_first:.1f} s after the enqueue "
            f"(executor CPU meanwhile: {cpu_first:.1f} s, {1000 * cpu_first / tasks:.1f} ms per task; "
            f"the last job enqueued after {t_enqueued:.1f} s; "
            f"the bench's own CPU, fake server included: {own_first:.1f} s); "
            f"first calls in flight after (s): {_quarters(arrivals)}",
            "",
            "| process | VmRSS MB | VmHWM (peak) MB | threads |",
            "| --- | ---: | ---: | ---: |",
            f"| raw arq worker, idle (peer) | {mb(arq_idle['VmRSS'])} | {mb(arq_idle['VmHWM'])} | "
            f"{arq_idle['Threads']} |",
            f"| taskloom executor, idle (before any job) | {mb(idle['VmRSS'])} | {mb(idle['VmHWM'])} | "
            f"{idle['Threads']} |",
            f"| taskloom executor, {tasks} tasks waiting on their 1st model call | {mb(loaded['VmRSS'])} | "
            f"{mb(loaded['VmHWM'])} | {loaded['Threads']} |",
            f"| taskloom executor, {tasks} tasks waiting on their 2nd model call | {mb(second['VmRSS'])} | "
            f"{mb(second['VmHWM'])} | {second['Threads']} |",
            "",
            f"peak / idle: {max(loaded['VmHWM'], second['VmHWM']) / idle['VmRSS']:.2f}x; "
            f"(peak - idle) / tasks: {per_task:.0f} kB per concurrent task; "
            f"idle taskloom executor / idle raw arq worker: {idle['VmRSS'] / arq_idle['VmRSS']:.2f}x",
            "",
            "| target (issue 32, for 1,000 tasks) | measured | |",
            "| --- | ---: | --- |",
            f"| every task's first model call within {FIRST_CALLS_S:g} s of the enqueue | {t_first:.1f} s | "
            f"{'met' if t_first <= FIRST_CALLS_S else '**not met**'} |",
            f"| peak memory <= {PEAK_MB:g} MB | {mb(peak)} MB | {'met' if peak / 1024 <= PEAK_MB else '**not met**'} |",
        ]
    )


def _quarters(arrivals: list[float]) -> str:
    """When a tenth, a quarter, half, three quarters and all of the first calls had arrived."""
    if not arrivals:
        return "none"
    marks = ((0.1, "10%"), (0.25, "25%"), (0.5, "50%"), (0.75, "75%"), (1.0, "all"))
    return ", ".join(f"{name} {arrivals[max(0, round(q * len(arrivals)) - 1)]:.2f}" for q, name in marks)


# Issue 32's targets for `--tasks 1000` (printed for any count: fewer tasks make them easier).
FIRST_CALLS_S = 3.0
PEAK_MB = 250.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--delay", type=float, default=5.0, help="seconds the fake model takes per call")
    args = parser.parse_args()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = asyncio.run(run(args.redis_url, args.tasks, args.delay))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
