"""Throughput: goals, tasks and jobs per second end to end with a model answering at once, with 1
and 2 executor processes, beside raw arq no-op jobs per second with as many worker processes.

    python -m bench.throughput [--redis-url redis://127.0.0.1:6379/0] [--goals 100] [--width 4] [--executors 1,2]
                               [--tracing]

taskloom: one planner, one critic and 1 (then 2) executor processes (`taskloom worker <role>`,
default concurrency 10, poll delay `--poll-delay`); `--goals` goals are submitted at once, each a
plan of `--width` independent tasks, each task a 2-step tool loop (tool call, answer), against the
fake Messages API answering at once (in this process). Timed from the first submit to the last goal
succeeded. One goal is at most 1 + 3 x width + 1 arq jobs (plan; execute, review, advance per task;
review_goal); the jobs counted are those that ran (their `job.start` log lines).

The peer, in the same run: raw arq worker processes (same concurrency and poll delay) with a no-op
function; `--arq-jobs` jobs enqueued at once, timed until the queue is empty. Also reported: the
worker processes' CPU time per job (from /proc) and Redis commands per job (`INFO commandstats`).
The report ends with issue 18's targets, met or not per executor count, from the same run, then the
floor (`bench.floor`: what the SDK's calls and a raw arq job cost on their own) and issue 32's target
on what is left, taskloom's own worker CPU per job. Keys live under a unique prefix and are deleted
afterwards.

`--no-hiredis`: the taskloom workers run with redis-py's pure-Python reply parser (hiredis hidden
from them), to measure what the optional `taskloom[fast]` extra buys.

`--tracing [--rounds N]`: instead of the arq peer, each executor count runs taskloom 4 x N times in
the same run, tracing off, on, on, off, ... (`TASKLOOM_TRACING=otlp`, every span sampled, exported over OTLP/HTTP with
the SDK's default batching to a sink in this process that accepts and drops them), and reports
goals/s of both and the loss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench._harness import (
    DEFAULT_REDIS,
    REPO,
    Bench,
    Responder,
    bench_redis,
    command_counts,
    goal_text,
    job_starts,
    machine,
    profile_from_now,
    spawn,
    spawn_worker,
    stop,
    wait_for_keys,
    worker_env,
)
from bench.floor import Floor
from bus.client import Client
from llm.testing import FakeAnthropicServer

STEPS = 1


@dataclass(frozen=True)
class Result:
    processes: int
    seconds: float
    goals: int
    tasks: int
    jobs: int
    cpu: float  # worker processes' CPU seconds
    commands: int
    own_cpu: float = 0.0  # this process's CPU seconds (the fake Messages API and the client)
    calls: int = 0  # model calls the fake Messages API answered


def cpu_seconds(procs: Sequence[subprocess.Popen[bytes]]) -> float:
    """User + system CPU time of the processes so far (/proc/<pid>/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in procs:
        with open(f"/proc/{p.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


class SpanSink:
    """An OTLP/HTTP endpoint on loopback that accepts every export and drops it (counting bytes)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.exports = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                sink.bytes += len(body)
                sink.exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def without_hiredis(bench: Bench, env: dict[str, str]) -> dict[str, str]:
    """`env` for worker processes that cannot import hiredis (redis-py then parses replies in Python):
    a `hiredis` package that raises ImportError, first on PYTHONPATH."""
    shim = bench.home / "no-hiredis" / "hiredis"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text('raise ImportError("hidden by bench.throughput --no-hiredis")\n')
    return {**env, "PYTHONPATH": os.pathsep.join([str(shim.parent), env.get("PYTHONPATH", "")])}


async def taskloom(
    bench: Bench,
    executors: int,
    goals: int,
    width: int,
    poll_delay: float,
    round_: int,
    traces: str | None = None,
    hiredis: bool = True,
) -> Result:
    """`traces`: an OTLP endpoint to export spans to (tracing on), None for tracing off. `hiredis`:
    False runs the workers with redis-py's pure-Python parser."""
    with FakeAnthropicServer() as fake:
        fake.respond_with(Responder(delay=0.0))
        tracing = {"TASKLOOM_TRACING": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": traces} if traces else {}
        env = worker_env(bench, poll_delay=poll_delay, base_url=fake.base_url, **tracing)
        if not hiredis:
            env = without_hiredis(bench, env)
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        try:
            for role in ["planner", "critic"] + ["executor"] * executors:
                logs.append(bench.home / f"{round_}-{role}-{len(procs)}.log")
                procs.append(spawn_worker(role, env, logs[-1]))
            await wait_for_keys(
                bench.redis, [bench.keys.health_check(r) for r in ("planner", "executor", "critic")], procs
            )
            await asyncio.sleep(1.0)  # every executor up (they share one health-check key)
            client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
            profile_from_now(procs)
            cpu0, cmd0, own0 = cpu_seconds(procs), await command_counts(bench.redis), time.process_time()
            t0 = time.perf_counter()
            ids = await asyncio.gather(*(client.submit(goal_text(width, 1, STEPS)) for _ in range(goals)))
            records = await asyncio.gather(*(client.wait(gid, timeout=300) for gid in ids))
            seconds = time.perf_counter() - t0
            cpu, cmds = cpu_seconds(procs) - cpu0, sum((await command_counts(bench.redis) - cmd0).values())
            own = time.process_time() - own0
            calls = len(fake.message_requests)
        finally:
            stop(procs)
    bad = [r for r in records if r.state.value != "succeeded"]
    if bad:
        raise RuntimeError(f"{len(bad)} goals did not succeed, e.g. {bad[0].state.value}: {bad[0].reason}")
    # The jobs that ran (their `job.start` lines): a planner may skip an advance that has nothing to
    # dispatch, so a goal is not always 2 + 3 x width jobs.
    jobs = sum(len(job_starts(log)) for log in logs)
    return Result(executors, seconds, goals, goals * width, jobs, cpu, cmds, own, calls)


async def raw_arq(bench: Bench, workers: int, jobs: int, poll_delay: float, round_: int) -> Result:
    queue = f"{bench.prefix}arq-{round_}"
    args = ["-m", "bench._harness", "noop", "--redis-url", bench.url, "--queue", queue, "--poll-delay", str(poll_delay)]
    env = worker_env(bench, poll_delay=poll_delay, base_url="http://127.0.0.1:9")
    procs = [spawn(args, env, bench.home / f"{round_}-arq-{i}.log") for i in range(workers)]
    try:
        await wait_for_keys(bench.redis, [f"{queue}:health-check"], procs)
        await asyncio.sleep(1.0)
        cpu0, cmd0 = cpu_seconds(procs), await command_counts(bench.redis)
        t0 = time.perf_counter()
        # Job ids under the run's prefix, so that cleanup deletes their result keys too (arq keeps
        # them under its fixed `arq:result:` prefix, an hour by default).
        await asyncio.gather(
            *(bench.redis.enqueue_job("noop", _queue_name=queue, _job_id=f"{queue}:{i}") for i in range(jobs))
        )
        while await bench.redis.zcard(queue):  # noqa: ASYNC110 - another process empties it
            await asyncio.sleep(0.005)
        seconds = time.perf_counter() - t0
        cpu, cmds = cpu_seconds(procs) - cpu0, sum((await command_counts(bench.redis) - cmd0).values())
    finally:
        stop(procs)
    return Result(workers, seconds, 0, 0, jobs, cpu, cmds)


async def floor(bench: Bench) -> Floor:
    """`bench.floor` in a process of its own (its CPU apart from ours), against a fake Messages API
    answering as in the taskloom runs."""
    with FakeAnthropicServer() as fake:
        fake.respond_with(Responder(delay=0.0))
        args = ["-m", "bench.floor", "--redis-url", bench.url, "--base-url", fake.base_url]
        env = worker_env(bench, poll_delay=0.05, base_url=fake.base_url)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, env=env, cwd=REPO, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench.floor exited with {proc.returncode}")
    return Floor(**json.loads(out.decode().strip().splitlines()[-1]))


async def run(
    url: str, goals: int, width: int, executors: list[int], arq_jobs: int, poll_delay: float, hiredis: bool = True
) -> str:
    async with bench_redis(url, "throughput") as bench:
        where = await machine(bench.redis, bench.where)
        under = await floor(bench)
        rows = []
        for i, n in enumerate(executors):
            ours = await taskloom(bench, n, goals, width, poll_delay, i, hiredis=hiredis)
            peer = await raw_arq(bench, n, arq_jobs, poll_delay, i)
            rows.append((ours, peer))
    table = report(where, goals, width, poll_delay, rows, under)
    return table + ("" if hiredis else "\n(taskloom workers without hiredis)")


def _sum(results: list[Result]) -> Result:
    """Several runs as one: their goals, jobs, seconds, CPU and commands added up."""
    return Result(
        results[0].processes,
        sum(r.seconds for r in results),
        sum(r.goals for r in results),
        sum(r.tasks for r in results),
        sum(r.jobs for r in results),
        sum(r.cpu for r in results),
        sum(r.commands for r in results),
        sum(r.own_cpu for r in results),
    )


async def run_tracing(
    url: str, goals: int, width: int, executors: list[int], poll_delay: float, rounds: int = 1
) -> str:
    sink = SpanSink()
    try:
        async with bench_redis(url, "throughput") as bench:
            where = await machine(bench.redis, bench.where)
            rows = []
            for i, n in enumerate(executors):
                # off, on, on, off: a load that drifts during the run (a shared machine) weighs on both alike.
                runs: dict[bool, list[Result]] = {False: [], True: []}
                before = sink.bytes
                for j, on in enumerate((False, True, True, False) * rounds):
                    traces = sink.endpoint if on else None
                    runs[on].append(await taskloom(bench, n, goals, width, poll_delay, 100 * i + j, traces=traces))
                rows.append((_sum(runs[False]), _sum(runs[True]), sink.bytes - before))
                each = ", ".join(f"{'on' if on else 'off'} {r.goals / r.seconds:.2f}" for on in runs for r in runs[on])
                print(f"{n} executor(s), goals/s of each run: {each}", flush=True)
    finally:
        sink.close()
    lines = [
        where,
        f"{goals} goals submitted at once, each {width} parallel tasks of a 2-step tool loop "
        f"({2 + 3 * width} model calls per goal: plan, 2 per task, a review per task, the final answer); "
        "zero-latency fake Messages API; "
        f"poll delay {poll_delay:g} s, concurrency 10 per worker; tracing on = every span sampled and exported",
        "",
        "| executor processes | goals/s tracing off | goals/s tracing on | loss | worker CPU ms per job: off / on "
        "| Redis commands per job: off / on | OTLP KB exported per goal |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for off, on, sent in rows:
        g_off, g_on = off.goals / off.seconds, on.goals / on.seconds
        lines.append(
            f"| {off.processes} (+1 planner, +1 critic) | {g_off:.1f} | {g_on:.1f} | {(1 - g_on / g_off) * 100:.1f}% | "
            f"{off.cpu / off.jobs * 1000:.1f} / {on.cpu / on.jobs * 1000:.1f} | "
            f"{off.commands / off.jobs:.1f} / {on.commands / on.jobs:.1f} | {sent / on.goals / 1024:.1f} |"
        )
    return "\n".join(lines)


def report(
    where: str, goals: int, width: int, poll_delay: float, rows: list[tuple[Result, Result]], under: Floor | None = None
) -> str:
    lines = [
        where,
        f"{goals} goals submitted at once, each {width} parallel tasks of a 2-step tool loop "
        f"({2 + 3 * width} model calls per goal: plan, 2 per task, a review per task, the final answer); "
        "zero-latency fake Messages API; "
        f"poll delay {poll_delay:g} s, concurrency 10 per worker",
        "",
        "| executor processes | goals/s | tasks/s | taskloom jobs/s | raw arq no-op jobs/s (same number of workers) "
        "| jobs/s ratio | worker CPU ms per job: taskloom / raw arq | Redis commands per job: taskloom / raw arq "
        "| fake API + client CPU ms per goal |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ours, peer in rows:
        lines[1] += f"; {ours.processes} executor(s): {ours.jobs / ours.goals:.1f} jobs per goal ran"
        jps, peer_jps = ours.jobs / ours.seconds, peer.jobs / peer.seconds
        lines.append(
            f"| {ours.processes} (+1 planner, +1 critic) | {ours.goals / ours.seconds:.1f} | "
            f"{ours.tasks / ours.seconds:.1f} | "
            f"{jps:.0f} | {peer_jps:.0f} | {jps / peer_jps:.3f} | "
            f"{ours.cpu / ours.jobs * 1000:.1f} / {peer.cpu / peer.jobs * 1000:.2f} | "
            f"{ours.commands / ours.jobs:.1f} / {peer.commands / peer.jobs:.1f} | "
            f"{ours.own_cpu / ours.goals * 1000:.1f} |"
        )
    return "\n".join([*lines, "", *targets(rows), *([] if under is None else ["", *floor_table(rows, under)])])


def targets(rows: list[tuple[Result, Result]]) -> list[str]:
    """Issue 18's targets per executor count, met or not, from the same run: at least 0.3x raw arq's
    jobs/s, at most 35 Redis commands and 3 ms of worker CPU per job."""
    out = [
        "| executor processes | jobs/s >= 0.3x raw arq | <= 35 Redis commands per job | <= 3 ms worker CPU per job |",
        "| ---: | --- | --- | --- |",
    ]
    for ours, peer in rows:
        ratio = (ours.jobs / ours.seconds) / (peer.jobs / peer.seconds)
        checks = (ratio >= 0.3, ours.commands / ours.jobs <= 35, ours.cpu / ours.jobs * 1000 <= 3)
        out.append(f"| {ours.processes} | " + " | ".join("met" if ok else "**not met**" for ok in checks) + " |")
    return out


def floor_table(rows: list[tuple[Result, Result]], under: Floor) -> list[str]:
    """Per executor count, the least a job can cost with the parts every job uses, from this run:
    a raw arq worker's CPU and commands per job (its peer run; the enqueue, which taskloom sends
    itself, taken out of the commands), and for each model call a job makes on average, the SDK's
    CPU and the ledger's reserve and settle (`bench.floor`)."""
    out = [
        f"Floor (`bench.floor`, same run): the Anthropic SDK {under.sdk_cpu_ms_per_call:.2f} ms of CPU per "
        f"model call ({under.metered_cpu_ms_per_call:.2f} ms with its ledger reserve and settle), the ledger "
        f"{under.ledger_commands_per_call:.1f} Redis commands per call, arq's enqueue "
        f"{under.enqueue_commands_per_job:.1f} commands per job.",
        "",
        "| executor processes | model calls per job | floor CPU ms per job: raw arq worker + SDK calls | target "
        "| floor Redis commands per job: raw arq worker + ledger | target "
        f"| taskloom's own worker CPU ms per job (worker CPU - floor) | issue 32: <= {OWN_CPU_TARGET_MS:g} ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for ours, peer in rows:
        calls = ours.calls / ours.jobs
        cpu = peer.cpu / peer.jobs * 1000 + calls * under.sdk_cpu_ms_per_call
        cmds = peer.commands / peer.jobs - under.enqueue_commands_per_job + calls * under.ledger_commands_per_call
        own = ours.cpu / ours.jobs * 1000 - cpu
        met = "met" if own <= OWN_CPU_TARGET_MS else f"**not met** ({own / OWN_CPU_TARGET_MS:.2f}x the target)"
        out.append(f"| {ours.processes} | {calls:.2f} | {cpu:.1f} | 3 | {cmds:.1f} | 35 | {own:.1f} | {met} |")
    return out


# Issue 32: taskloom's own worker CPU per job, net of the floor the same run measures (the SDK's calls
# and a raw arq worker's job), at most this many ms.
OWN_CPU_TARGET_MS = 4.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--goals", type=int, default=100)
    parser.add_argument("--width", type=int, default=4, help="parallel tasks per goal")
    parser.add_argument("--executors", default="1,2", help="executor process counts to measure")
    parser.add_argument("--arq-jobs", type=int, default=3000)
    parser.add_argument("--poll-delay", type=float, default=0.05)
    parser.add_argument("--tracing", action="store_true", help="compare tracing off and on (instead of raw arq)")
    parser.add_argument("--rounds", type=int, default=1, help="with --tracing: off/on/on/off this many times")
    parser.add_argument("--no-hiredis", action="store_true", help="run the taskloom workers without hiredis")
    args = parser.parse_args()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    executors = [int(n) for n in args.executors.split(",")]
    if args.tracing:
        table = asyncio.run(
            run_tracing(args.redis_url, args.goals, args.width, executors, args.poll_delay, args.rounds)
        )
    else:
        table = asyncio.run(
            run(
                args.redis_url,
                args.goals,
                args.width,
                executors,
                args.arq_jobs,
                args.poll_delay,
                hiredis=not args.no_hiredis,
            )
        )
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
