"""Redis commands and round trips per job type, counted with MONITOR while goals run one at a time.

    python -m bench.roundtrips [--redis-url redis://127.0.0.1:6379/0] [--goals 5] [--steps 1] [--width 1]

One planner, one critic and one executor process (`taskloom worker <role>`, the throughput
benchmark's settings); `--goals` goals of one task each (a `--steps`-step tool loop, then the
answer) are run one after another against the zero-latency fake Messages API, so that no two jobs
overlap. A MONITOR connection records every command Redis executes, including those a Lua script
runs (INFO commandstats counts them too, so they count here). Each command is charged to a job:

* a command sent while a job runs (between its `job.start` and `job.end` log lines), other than a
  worker's idle traffic, is that job's handler's ("handler");
* a command outside every job that names a job id (arq picking the job up, marking it in progress,
  counting its tries, storing its result, deleting it) is arq's for that job ("arq");
* a command a script runs belongs to the EVALSHA that ran it.

`--width N` runs goals of N parallel tasks (the shape of `bench.throughput`): jobs of the same type
then overlap in one process, so a command goes to one of them; the totals per type still hold.

What is left is idle traffic (queue polls, wake-up reads, heartbeats, health checks, watchdog and
supervisor passes) and the benchmark's own client (submit, wait), reported per goal. Round trips
count what a client sent: MULTI...EXEC is one, and so is a pipeline. MONITOR does not mark a
pipeline; Redis runs the commands a client sent together one after the other, before any other
client's, so a command that follows its client's previous one (and that one's script) within
PIPELINE_GAP_S, with no other client's command between, is counted in the same round trip. A new
round trip cannot start that soon: the client must first read the reply and send again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from redis.asyncio import Redis

from bench._harness import (
    DEFAULT_REDIS,
    Responder,
    bench_redis,
    goal_text,
    machine,
    spawn_worker,
    stop,
    wait_for_keys,
    worker_env,
)
from bus.client import Client
from bus.connection import RedisPool
from llm.testing import FakeAnthropicServer

ORDER = ["plan", "execute", "review", "advance", "review_goal", "replan"]
# A worker's traffic that belongs to no job: arq's queue poll, the wake-up read, health checks,
# heartbeats and lease/supervisor scans (their key names, as bus.keys spells them).
IDLE = re.compile(
    r'^"(ZRANGEBYSCORE|XREAD|XREVRANGE|PSETEX|ZADD|ZREMRANGEBYSCORE|ZCARD|ZRANGE)" "[^"]*'
    r'(queue:(planner|executor|critic)"|:wake"|health-check|workers:|"leases"|goals:active"|ledger:expiry")'
)


# Longest gap between the end of a client's command and its next one for both to count as one
# pipeline (one round trip). Measured under MONITOR on the 2-core machine (bench/RESULTS.md): the
# commands of a pipeline followed each other within 0-45 us, a client's next round trip came 60 us
# or more after its previous command (a PING round trip alone is 75-160 us there).
PIPELINE_GAP_S = 50e-6


@dataclass
class Command:
    t: float
    client: str  # host:port, or "lua" for a command a script ran
    name: str
    raw: str
    piped: bool = False  # sent in the same pipeline as its client's previous command (see the module doc)


@dataclass
class Job:
    role: str
    function: str
    job_id: str
    start: float
    end: float


@dataclass
class Tally:
    jobs: int = 0
    handler: int = 0  # commands, scripts' included
    handler_trips: int = 0
    arq: int = 0
    arq_trips: int = 0
    by_command: Counter[str] = field(default_factory=Counter)
    first: list[str] = field(default_factory=list)  # the commands of the first job of this type, in order
    first_id: str = ""


def _ts(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def read_jobs(logs: dict[str, Path]) -> list[Job]:
    """Each job's window from the workers' JSON logs (job.start ... job.end), by role."""
    starts: dict[str, tuple[str, float]] = {}
    jobs: list[Job] = []
    for role, log in logs.items():
        for line in log.read_text(errors="replace").splitlines():
            if '"job.start"' not in line and '"job.end"' not in line:
                continue
            with contextlib.suppress(ValueError, KeyError):
                rec = json.loads(line)
                if rec["event"] == "job.start":
                    starts[rec["job_id"]] = (rec["function"], _ts(rec["timestamp"]))
                elif rec["job_id"] in starts:
                    fn, t0 = starts.pop(rec["job_id"])
                    jobs.append(Job(role, fn, rec["job_id"], t0, _ts(rec["timestamp"])))
    return sorted(jobs, key=lambda j: j.start)


def parse_monitor(lines: list[str], prefix: str) -> list[Command]:
    """MONITOR lines of this run (its key prefix, or a script or transaction of one of its clients)."""
    out: list[Command] = []
    ours: set[str] = set()
    pat = re.compile(r"^(\d+\.\d+) \[\d+ ([^\]]+)\] (.*)$")
    for line in lines:
        m = pat.match(line)
        if not m:
            continue
        client, raw = m.group(2), m.group(3)
        if client != "lua" and prefix in raw:
            ours.add(client)
        out.append(Command(float(m.group(1)), client, raw.split(" ", 1)[0].strip('"').upper(), raw))
    kept: list[Command] = []
    last, last_t = "", 0.0
    for c in out:
        if c.client == "lua":
            if last in ours:
                kept.append(c)
            last_t = c.t
            continue
        c.piped = c.client == last and c.t - last_t <= PIPELINE_GAP_S
        last, last_t = c.client, c.t
        if c.client in ours:
            kept.append(c)
    return kept


def attribute(
    commands: list[Command], jobs: list[Job], roles: dict[str, str], client_addrs: set[str], prefix: str
) -> tuple[dict[str, Tally], Counter[str]]:
    """Charge each command to a job type (handler or arq part), or to idle/client traffic.

    `roles`: client address -> role of the worker process that owns the connection."""
    tallies: dict[str, Tally] = defaultdict(Tally)
    for j in jobs:
        tallies[j.function].jobs += 1
    ids = {j.job_id: j for j in jobs}
    id_pat = re.compile(re.escape(prefix) + r"job:[^\"]+")
    other: Counter[str] = Counter()
    owner: tuple[str, str, str] | None = None  # (function, part) of the last EVALSHA, for its script's commands
    script_of = "idle (polls, wake-ups, heartbeats, health checks)"  # who ran a script no job owns
    pending: dict[str, int] = {}  # client -> a MULTI not yet charged
    last: dict[str, tuple[str, str, str]] = {}  # client -> owner of its open transaction
    for c in commands:
        if c.client == "lua":
            if owner is not None:
                setattr(tallies[owner[0]], owner[1], getattr(tallies[owner[0]], owner[1]) + 1)
                tallies[owner[0]].by_command[c.name] += 1
                if owner[2] == tallies[owner[0]].first_id:
                    tallies[owner[0]].first.append(f"{owner[1]:7}   lua {_short(c.raw, prefix)}")
            else:
                other[script_of] += 1
            continue
        owner = None
        script_of = "idle (polls, wake-ups, heartbeats, health checks)"
        if c.client in client_addrs:
            other["benchmark client (submit, wait)"] += 1
            script_of = "benchmark client (submit, wait)"
            continue
        if c.name == "MULTI":  # charged with the transaction's first command that names its owner
            pending[c.client] = 1
            continue
        role = roles.get(c.client)
        m = id_pat.search(c.raw)
        named = ids.get(m.group(0)) if m else None
        running = next((j for j in jobs if j.role == role and j.start <= c.t <= j.end), None)
        closing = c.name == "EXEC" and c.client in last
        if closing:
            fn, part, jid = last.pop(c.client)
        elif named is not None and named.role == role and named is not running:
            fn, part, jid = named.function, "arq", named.job_id  # the process picking up or finishing another job
        elif running is not None and not IDLE.match(c.raw):
            fn, part, jid = running.function, "handler", running.job_id
        elif named is not None:
            fn, part, jid = named.function, "arq", named.job_id
        else:
            other["idle (polls, wake-ups, heartbeats, health checks)"] += 1 + pending.pop(c.client, 0)
            continue
        t = tallies[fn]
        if not t.first_id:
            t.first_id = jid
        opened = pending.pop(c.client, 0)
        if jid == t.first_id:
            t.first.extend([f"{part:7} {'MULTI'}"] * opened + [f"{part:7} {_short(c.raw, prefix)}"])
        in_tx = bool(opened) or c.client in last
        setattr(t, part, getattr(t, part) + 1 + opened)
        if opened or not (in_tx or closing or c.piped):
            setattr(t, f"{part}_trips", getattr(t, f"{part}_trips") + 1)
        t.by_command[c.name] += 1
        if opened:
            t.by_command["MULTI"] += 1
        if in_tx and c.name != "EXEC":
            last[c.client] = (fn, part, jid)
        owner = (fn, part, jid) if c.name in ("EVALSHA", "EVAL") else None
    return tallies, other


def _short(raw: str, prefix: str) -> str:
    return re.sub(r"[0-9a-f]{32}", "<id>", raw.replace(prefix, ""))[:110]


def connection_roles(procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, str]:
    """host:port of each open TCP connection of the worker processes -> the process's role (/proc)."""
    inode_role: dict[str, str] = {}
    for role, p in procs.items():
        fd_dir = Path(f"/proc/{p.pid}/fd")
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inode_role[target[8:-1]] = role
    out: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[9] in inode_role:
                    port = int(f[1].rsplit(":", 1)[1], 16)
                    out[f"127.0.0.1:{port}"] = inode_role[f[9]]
    return out


async def _client_addrs(redis: Redis) -> set[str]:
    info = await redis.client_info()
    return {str(info["addr"])}


async def run(url: str, goals: int, steps: int, poll_delay: float, detail: bool = False, width: int = 1) -> str:
    async with bench_redis(url, "roundtrips") as bench:
        where = await machine(bench.redis, bench.where)
        client_redis = RedisPool.from_url(bench.url, single_connection_client=True)
        with FakeAnthropicServer() as fake:
            fake.respond_with(Responder(delay=0.0))
            env = worker_env(bench, poll_delay=poll_delay, base_url=fake.base_url)
            logs = {role: bench.home / f"{role}.log" for role in ("planner", "critic", "executor")}
            by_role = {role: spawn_worker(role, env, log) for role, log in logs.items()}
            procs = list(by_role.values())
            monitor = bench.home / "monitor.txt"
            mon: subprocess.Popen[bytes] | None = None
            try:
                await wait_for_keys(bench.redis, [bench.keys.health_check(r) for r in logs], procs)
                await asyncio.sleep(1.0)
                client = Client(client_redis, bench.keys, default_budget_tokens=10_000_000)
                addrs = await _client_addrs(client_redis)
                host, port = _host_port(bench.url)
                with monitor.open("wb") as out:
                    # Started once, before any timing; its output goes straight to a file.
                    mon = subprocess.Popen(["redis-cli", "-h", host, "-p", str(port), "monitor"], stdout=out)  # noqa: ASYNC220
                await asyncio.sleep(0.3)
                t0 = time.perf_counter()
                for _ in range(goals):
                    gid = await client.submit(goal_text(width, 1, steps))
                    record = await client.wait(gid, timeout=60)
                    if record.state.value != "succeeded":
                        raise RuntimeError(f"goal {gid} ended {record.state.value}: {record.reason}")
                    await asyncio.sleep(0.3)  # arq stores the last job's result after its job.end
                seconds = time.perf_counter() - t0
                roles = connection_roles(by_role)
            finally:
                if mon is not None:
                    mon.terminate()
                    mon.wait()
                stop(procs)
                await client_redis.aclose()
        commands = parse_monitor(monitor.read_text(errors="replace").splitlines(), bench.prefix)
        tallies, other = attribute(commands, read_jobs(logs), roles, addrs, bench.prefix)
    table = report(where, goals, steps, poll_delay, seconds, tallies, other, width)
    if detail:
        for fn in [*ORDER, *sorted(set(tallies) - set(ORDER))]:
            if fn in tallies and tallies[fn].first:
                table += f"\n\n{fn} (the first one, in order):\n" + "\n".join(tallies[fn].first)
    return table


def _host_port(url: str) -> tuple[str, int]:
    m = re.match(r"redis://(?:[^@]*@)?([^:/]+)(?::(\d+))?", url)
    if not m:
        raise ValueError(f"--redis-url: need a redis://host:port URL for redis-cli monitor, got {url!r}")
    return m.group(1), int(m.group(2) or 6379)


def report(
    where: str,
    goals: int,
    steps: int,
    poll_delay: float,
    seconds: float,
    tallies: dict[str, Tally],
    other: Counter[str],
    width: int = 1,
) -> str:
    lines = [
        where,
        f"{goals} goals of {width} parallel task(s) ({steps}-step tool loop + answer), one goal at a time; "
        f"poll delay {poll_delay:g} s; "
        f"{seconds:.1f} s",
        "",
        "| job | jobs | handler commands / job | handler round trips / job | arq commands / job "
        "| arq round trips / job | total commands / job | top handler commands / job |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    total_cmds = total_jobs = 0
    for fn in [*ORDER, *sorted(set(tallies) - set(ORDER))]:
        t = tallies.get(fn)
        if t is None or t.jobs == 0:
            continue
        n = t.jobs
        top = ", ".join(f"{k} {v / n:.1f}" for k, v in t.by_command.most_common(6))
        lines.append(
            f"| {fn} | {n} | {t.handler / n:.1f} | {t.handler_trips / n:.1f} | {t.arq / n:.1f} | "
            f"{t.arq_trips / n:.1f} | {(t.handler + t.arq) / n:.1f} | {top} |"
        )
        total_cmds += t.handler + t.arq
        total_jobs += n
    lines.append(
        f"| all jobs | {total_jobs} | | | | | {total_cmds / max(1, total_jobs):.1f} | "
        f"per goal: {total_cmds / max(1, goals):.0f} |"
    )
    lines.append("")
    lines.append(
        "Not charged to a job (per goal): "
        + ", ".join(f"{k} {v / max(1, goals):.1f}" for k, v in sorted(other.items()))
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--goals", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1, help="tool calls per task before its answer")
    parser.add_argument("--poll-delay", type=float, default=0.05)
    parser.add_argument("--detail", action="store_true", help="also list the commands of one job of each type")
    parser.add_argument("--width", type=int, default=1, help="parallel tasks per goal")
    args = parser.parse_args()
    started = datetime.now(UTC)
    table = asyncio.run(run(args.redis_url, args.goals, args.steps, args.poll_delay, args.detail, args.width))
    print(f"{started:%Y-%m-%d %H:%M} UTC\n{table}")


if __name__ == "__main__":
    main()
