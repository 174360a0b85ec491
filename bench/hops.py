"""Hop latency: from one state change being committed to the next job starting, with a model that
answers at once, beside a Redis PING and arq's own enqueue-to-start latency at the same poll delay.

    python -m bench.hops [--redis-url redis://127.0.0.1:6379/0] [--poll-delay 0.05] [--goals 5] [--chain 20]

Real worker processes (`taskloom worker planner|executor|critic`) run goals whose plan is a chain
of `--chain` tasks (each answers in one model turn) against the fake Messages API answering at
once. Hops come from the goal's event stream (`task.state` events carry `at`, taken just before
the state change's script runs) and the workers' `job.start` log lines:

- result stored -> review starting: task `reviewing` -> critic `job.start review`
- task accepted -> advance starting: task `done` -> planner `job.start advance`
- task ready -> execute starting: task `ready` -> executor `job.start execute`
- task accepted -> dependent task running: task `done` -> next task `running` (both hops above plus
  the planner's advance work)

The peers, in the same run: PING round trips; a raw arq worker process with a no-op function at the
same poll delay and concurrency (enqueue -> start); the same worker with a prototype wake-up (it
blocks on a stream that the producer XADDs to after each enqueue, polling at most every
`--wake-fallback` s; not part of taskloom). Idle load: Redis commands per second (`INFO
commandstats` deltas, minus the background rate measured with no worker running) for each idle
taskloom worker process, for the raw arq worker, for the wake-up prototype, and for a raw arq
worker at several poll delays. Keys live under a unique prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from arq.worker import Worker

from bench._harness import (
    DEFAULT_REDIS,
    Bench,
    Responder,
    bench_redis,
    command_rate,
    goal_text,
    job_starts,
    machine,
    ms,
    noop_worker,
    pct,
    spawn,
    spawn_worker,
    stop,
    task_id,
    wait_for_keys,
    worker_env,
)
from bus.client import Client
from bus.events import EventLog
from bus.schemas import Event
from llm.testing import FakeAnthropicServer

ROLES = ("planner", "executor", "critic")
SWEEP = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Row:
    name: str
    values: list[float]

    def cells(self) -> str:
        v = sorted(self.values)
        return f"{len(v)} | {ms(pct(v, 50))} | {ms(pct(v, 99))} | {ms(sum(v) / len(v))}" if v else "0 | - | - | -"


async def ping_latencies(bench: Bench, n: int = 300) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await bench.redis.ping()
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0.001)
    return out


async def idle_rate(bench: Bench, seconds: float, background: float) -> tuple[float, dict[str, float]]:
    rate, delta = await command_rate(bench.redis, seconds)
    per_cmd = {k: v / seconds for k, v in delta.items() if v and k != "info"}
    return max(0.0, rate - background), per_cmd


async def arq_latencies(
    bench: Bench, n: int, poll_delay: float, enqueue: Callable[[float, str], Awaitable[Any]], out: str
) -> list[float]:
    """Enqueue `n` no-op jobs one at a time, at random phases of the poll cycle; each one's
    enqueue -> start latency, as the job itself measured it."""
    lat = []
    for _ in range(n):
        await asyncio.sleep(random.uniform(0, poll_delay) + 0.002)
        await enqueue(time.time(), out)
        got: Any = await bench.redis.blpop([out], timeout=10)  # type: ignore[misc]
        if got is None:
            raise TimeoutError("the raw arq worker did not run a job within 10 s")
        lat.append(float(got[1]))
    return lat


async def raw_arq(
    bench: Bench, poll_delay: float, n: int, idle_s: float, background: float, wake: float | None
) -> tuple[list[float], float, dict[str, float]]:
    """Latencies and idle load of a raw arq worker process (with the wake-up prototype if `wake`)."""
    name = "wake" if wake else "arq"
    queue = f"{bench.prefix}{name}-queue"
    stream = f"{bench.prefix}{name}-wake"
    args = ["-m", "bench._harness", "noop", "--redis-url", bench.url, "--queue", queue, "--poll-delay", str(poll_delay)]
    if wake:
        args += ["--wake", stream, "--fallback", str(wake)]
    proc = spawn(
        args, worker_env(bench, poll_delay=poll_delay, base_url="http://127.0.0.1:9"), bench.home / f"{name}.log"
    )
    try:
        await wait_for_keys(bench.redis, [f"{queue}:health-check"], [proc])
        await asyncio.sleep(0.3)
        idle, per_cmd = await idle_rate(bench, idle_s, background)

        ids = itertools.count()

        async def enqueue(sent: float, out: str) -> None:
            # An id under the run's prefix: cleanup deletes its result key (arq keeps it an hour).
            await bench.redis.enqueue_job("noop", sent, out, _queue_name=queue, _job_id=f"{queue}:{next(ids)}")
            if wake:
                await bench.redis.xadd(stream, {"j": "1"}, maxlen=1000, approximate=True)

        lat = await arq_latencies(bench, n, poll_delay, enqueue, f"{bench.prefix}{name}-lat")
    finally:
        stop([proc])
    return lat, idle, per_cmd


async def sweep_idle(bench: Bench, seconds: float, background: float) -> list[tuple[float, float]]:
    """Idle commands/s of a raw arq worker (in this process) at each poll delay of SWEEP."""
    out = []
    for delay in SWEEP:
        worker: Worker = noop_worker(bench.redis, f"{bench.prefix}sweep", delay, 10)
        task = asyncio.create_task(worker.main())
        await asyncio.sleep(0.3)
        rate, _ = await idle_rate(bench, seconds, background)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        out.append((delay, rate))
    return out


def event_times(events: list[Event]) -> dict[tuple[str, str], datetime]:
    """(task_id, state) -> time of the first task.state event into that state."""
    out: dict[tuple[str, str], datetime] = {}
    for e in events:
        if e.type == "task.state" and e.task_id:
            out.setdefault((e.task_id, str(e.data.get("state"))), e.at)
    return out


def hops_of(
    bench: Bench, gid: str, chain: int, events: list[Event], starts: dict[str, datetime]
) -> dict[str, list[float]]:
    at = event_times(events)
    hops: dict[str, list[float]] = {k: [] for k in ("review", "advance", "execute", "dependent", "advance_work")}

    def job(kind: str, tid: str) -> str:
        return bench.keys.job_id(kind, gid, tid, 1)

    for j in range(chain):
        tid = task_id(0, j)
        pairs = (
            ("review", (tid, "reviewing"), job("review", tid)),
            ("advance", (tid, "done"), job("advance", tid)),
            ("execute", (tid, "ready"), job("execute", tid)),
        )
        for name, key, jid in pairs:
            if key in at and jid in starts:
                hops[name].append((starts[jid] - at[key]).total_seconds())
        if j + 1 < chain:
            nxt = task_id(0, j + 1)
            if (tid, "done") in at and (nxt, "running") in at:
                hops["dependent"].append((at[(nxt, "running")] - at[(tid, "done")]).total_seconds())
            if job("advance", tid) in starts and (nxt, "ready") in at:
                hops["advance_work"].append((at[(nxt, "ready")] - starts[job("advance", tid)]).total_seconds())
    return hops


async def taskloom_hops(
    bench: Bench, poll_delay: float, goals: int, chain: int, idle_s: float, background: float
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, dict[str, float]], float]:
    """Hops from real worker processes; idle commands/s per role process; seconds for the goals."""
    # The executor's and the critic's model calls answer after a random 0..poll delay: that keeps the
    # workers' poll cycles from locking into step along a chain; it falls outside every hop measured.
    responder = Responder(delay=0.0, jitter=poll_delay)
    procs = []
    idle: dict[str, float] = {}
    idle_cmds: dict[str, dict[str, float]] = {}
    with FakeAnthropicServer() as fake:
        fake.respond_with(responder)
        env = worker_env(bench, poll_delay=poll_delay, base_url=fake.base_url)
        logs = {role: bench.home / f"{role}.log" for role in ROLES}
        try:
            seen: dict[str, float] = {}
            for role in ROLES:  # started one at a time, so each one's idle load can be told apart
                procs.append(spawn_worker(role, env, logs[role]))
                await wait_for_keys(bench.redis, [bench.keys.health_check(role)], procs)
                await asyncio.sleep(0.5)
                total, per_cmd = await idle_rate(bench, idle_s, background + sum(idle.values()))
                idle[role] = total
                idle_cmds[role] = {k: v - seen.get(k, 0.0) for k, v in per_cmd.items() if v - seen.get(k, 0.0) > 0.05}
                seen = per_cmd
            client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
            ids = []
            t0 = time.perf_counter()
            for _ in range(goals):  # one at a time: hops without contention
                gid = await client.submit(goal_text(1, chain, 0))
                record = await client.wait(gid, timeout=120)
                if record.state.value != "succeeded":
                    raise RuntimeError(f"goal {gid} ended {record.state.value}: {record.reason}")
                ids.append(gid)
            seconds = time.perf_counter() - t0
        finally:
            stop(procs)
    starts: dict[str, datetime] = {}
    for log in logs.values():
        starts.update(job_starts(log))
    log_events = EventLog(bench.redis, bench.keys)
    hops: dict[str, list[float]] = {}
    for gid in ids:
        for name, values in hops_of(bench, gid, chain, await log_events.read(gid, count=100_000), starts).items():
            hops.setdefault(name, []).extend(values)
    return hops, idle, idle_cmds, seconds


async def run(
    url: str, poll_delay: float, goals: int, chain: int, arq_jobs: int, idle_s: float, wake_fallback: float
) -> str:
    async with bench_redis(url, "hops") as bench:
        where = await machine(bench.redis, bench.where)
        ping = await ping_latencies(bench)
        background, _ = await command_rate(bench.redis, idle_s)
        arq_lat, arq_idle, arq_cmds = await raw_arq(bench, poll_delay, arq_jobs, idle_s, background, None)
        wake_lat, wake_idle, wake_cmds = await raw_arq(bench, poll_delay, arq_jobs, idle_s, background, wake_fallback)
        hops, idle, idle_cmds, seconds = await taskloom_hops(bench, poll_delay, goals, chain, idle_s, background)
        sweep = await sweep_idle(bench, max(1.0, idle_s / 2), background)
        background_after, _ = await command_rate(bench.redis, idle_s)
    return report(
        where, poll_delay, goals, chain, ping, arq_lat, wake_lat, wake_fallback, hops, seconds,
        idle, idle_cmds, arq_idle, arq_cmds, wake_idle, wake_cmds, sweep, (background, background_after),
    )  # fmt: skip


def report(
    where: str,
    poll_delay: float,
    goals: int,
    chain: int,
    ping: list[float],
    arq_lat: list[float],
    wake_lat: list[float],
    wake_fallback: float,
    hops: dict[str, list[float]],
    seconds: float,
    idle: dict[str, float],
    idle_cmds: dict[str, dict[str, float]],
    arq_idle: float,
    arq_cmds: dict[str, float],
    wake_idle: float,
    wake_cmds: dict[str, float],
    sweep: list[tuple[float, float]],
    background: tuple[float, float],
) -> str:
    arq50 = pct(sorted(arq_lat), 50)
    arq99 = pct(sorted(arq_lat), 99)
    rows = [
        Row("result stored -> review starting (taskloom)", hops.get("review", [])),
        Row("task accepted -> advance starting (taskloom)", hops.get("advance", [])),
        Row("task ready -> execute starting (taskloom)", hops.get("execute", [])),
        Row("task accepted -> dependent task running (taskloom, 2 hops + advance work)", hops.get("dependent", [])),
        Row("  of which: advance job start -> dependent task ready (planner work)", hops.get("advance_work", [])),
        Row(f"raw arq no-op: enqueue -> start (poll {poll_delay:g} s)", arq_lat),
        Row(f"raw arq + wake-up prototype: enqueue -> start (fallback poll {wake_fallback:g} s)", wake_lat),
        Row("Redis PING round trip", ping),
    ]
    lines = [
        where,
        f"poll delay {poll_delay:g} s, concurrency 10 per role; {goals} goals x chain of {chain} tasks "
        f"({goals * chain} tasks, {seconds:.1f} s); zero-latency fake Messages API",
        "",
        "| hop | n | p50 ms | p99 ms | mean ms | p50 / arq p50 | p99 / arq p99 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        v = sorted(row.values)
        ratio = f"{pct(v, 50) / arq50:.2f} | {pct(v, 99) / arq99:.2f}" if v else "- | -"
        lines.append(f"| {row.name} | {row.cells()} | {ratio} |")
    lines += [
        "",
        f"Idle Redis load (commands/s, background of {background[0]:.1f}/s before and {background[1]:.1f}/s "
        "after subtracted):",
        "",
        "| idle process | commands/s | top commands (/s) |",
        "| --- | ---: | --- |",
    ]

    def top(cmds: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in sorted(cmds.items(), key=lambda kv: -kv[1])[:5])

    for role in ROLES:
        lines.append(
            f"| taskloom worker {role} (poll {poll_delay:g} s) | {idle.get(role, 0):.1f} | "
            f"{top(idle_cmds.get(role, {}))} |"
        )
    lines.append(f"| raw arq worker (poll {poll_delay:g} s) | {arq_idle:.1f} | {top(arq_cmds)} |")
    lines.append(f"| raw arq + wake-up prototype (fallback {wake_fallback:g} s) | {wake_idle:.1f} | {top(wake_cmds)} |")
    lines += ["", "| raw arq poll delay s | " + " | ".join(f"{d:g}" for d, _ in sweep) + " |"]
    lines.append("| ---: | " + " | ".join("---:" for _ in sweep) + " |")
    lines.append("| idle commands/s | " + " | ".join(f"{r:.1f}" for _, r in sweep) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--poll-delay", type=float, default=0.05, help="TASKLOOM_POLL_DELAY (and the raw arq worker's)")
    parser.add_argument("--goals", type=int, default=5)
    parser.add_argument(
        "--chain",
        type=int,
        default=20,
        help="tasks per goal (at most TASKLOOM_MAX_PLAN_TASKS), each depending on the previous one",
    )
    parser.add_argument("--arq-jobs", type=int, default=300, help="no-op jobs for each raw arq latency figure")
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=6.0,
        help="window per idle figure (>5: health checks and watchdogs run every 5 s)",
    )
    parser.add_argument("--wake-fallback", type=float, default=1.0)
    args = parser.parse_args()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = asyncio.run(
        run(
            args.redis_url,
            args.poll_delay,
            args.goals,
            args.chain,
            args.arq_jobs,
            args.idle_seconds,
            args.wake_fallback,
        )
    )
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
