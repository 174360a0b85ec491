"""Shared pieces of the benchmarks: Redis with a unique prefix and cleanup, a scripted model that
answers every role at a fixed delay, worker processes, Redis command counting, and a raw arq
worker (the peer figure) that can also be run with a prototype wake-up signal.

    python -m bench._harness noop --redis-url URL --queue Q --poll-delay S [--wake STREAM --fallback S]

runs the raw arq worker (used by `bench.hops` and `bench.throughput` as a subprocess).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from arq.connections import ArqRedis, create_pool
from arq.worker import Worker, func

from bus.connection import EmbeddedRedis, redis_settings
from bus.keys import Keys
from bus.retention import delete_all
from critic.prompts import FINAL_SYSTEM, FINAL_TOOL, REVIEW_SYSTEM
from executor.loop import SYSTEM as EXECUTOR_SYSTEM
from llm.testing import RecordedRequest, Script, content_text, text_reply, tool_reply
from planner.prompts import PLAN_TOOL
from planner.prompts import SYSTEM as PLANNER_SYSTEM
from taskloom import eventloop
from taskloom.settings import Settings, load_settings

REPO = Path(__file__).resolve().parent.parent
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
TOOLS = "bench.toolkit:kit"
FAKE_KEY = "bench-not-a-real-key"
FAKE_MODEL = "claude-bench"


def fake_worker_settings(redis_url: str, base_url: str, prefix: str) -> Settings:
    """The settings of a measured worker process whose model is the fake Messages API at `base_url`
    (set in the environment too, as a worker started by hand would find them)."""
    os.environ.update(
        TASKLOOM_REDIS_URL=redis_url,
        TASKLOOM_KEY_PREFIX=prefix,
        TASKLOOM_MODEL=FAKE_MODEL,
        ANTHROPIC_API_KEY=FAKE_KEY,
        ANTHROPIC_BASE_URL=base_url,
    )
    if os.environ.get("BENCH_HTTP_CLIENT"):  # as worker_env passes it to the measured workers
        os.environ["TASKLOOM_HTTP_CLIENT"] = os.environ["BENCH_HTTP_CLIENT"]
    return load_settings()

# -- numbers --------------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100, inclusive method); nan for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return values[0] if q <= 0 else cuts[min(98, max(0, round(q) - 1))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


# -- machine and Redis ----------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


async def machine(redis: ArqRedis, where: str) -> str:
    """The machine and, measured now, how fast it is at the moment (`cpu_probe_ms`, `ping_p50_us`)."""
    info = await redis.info("server")
    return (
        f"{os.cpu_count()} cores ({cpu_model()}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, Redis {info.get('redis_version', '?')} at {where}, "
        f"workers on {workers_loop()}; "
        f"speed now: CPU probe {cpu_probe_ms():.1f} ms, PING p50 {await ping_p50_us(redis):.0f} µs"
    )


def workers_loop() -> str:
    """The event loop the measured workers run on: `BENCH_EVENT_LOOP`, else their default (`auto`)."""
    return eventloop.choice(os.environ.get("BENCH_EVENT_LOOP") or "auto")


def cpu_probe_ms() -> float:
    """CPU milliseconds a fixed pure-Python workload (string formatting, JSON, dict reads and writes,
    as a job's code does) takes in this process, best of 5. The same code on the same machine class
    ran up to 2x faster or slower from one hour to the next (bench/RESULTS.md): printed with every
    report, it says which runs can be compared and how much of a difference is the machine's."""

    def work() -> None:
        d: dict[str, str] = {}
        for i in range(20_000):
            k = f"key-{i % 500}"
            d[k] = json.dumps({"i": i, "k": k, "ok": True})
            d.get(k[::-1])

    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        work()
        best = min(best, time.process_time() - t0)
    return best * 1000


async def ping_p50_us(redis: ArqRedis, n: int = 300) -> float:
    """Median microseconds of a PING round trip from this process (the loopback's and Redis's speed now)."""
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await redis.ping()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat) * 1e6


@dataclass
class Bench:
    """A Redis connection, the URL worker processes use, and this run's unique key prefix."""

    url: str
    where: str
    redis: ArqRedis
    prefix: str
    home: Path
    keys: Keys = field(init=False)

    def __post_init__(self) -> None:
        self.keys = Keys(prefix=self.prefix)

    async def cleanup(self) -> int:
        """Delete every key of this run: ours and arq's job/result keys (their ids carry the prefix)."""
        return await delete_all(self.redis, self.keys)


@contextlib.asynccontextmanager
async def bench_redis(url: str, name: str) -> AsyncIterator[Bench]:
    """Redis at `url` (or an embedded redis-server when it cannot be reached) with a fresh prefix,
    whose keys are deleted on exit."""
    prefix = f"bench-{name}-{uuid.uuid4().hex[:10]}:"
    with tempfile.TemporaryDirectory(prefix=f"taskloom-bench-{name}-") as tmp:
        home = Path(tmp)
        embedded: EmbeddedRedis | None = None
        where = url
        try:
            probe = await create_pool(redis_settings(url))
            await probe.ping()
            await probe.aclose()
        except Exception:
            embedded = EmbeddedRedis(home / "redis")
            url = await asyncio.to_thread(embedded.acquire)
            where = "embedded redis-server (unix socket; the URL was not reachable)"
        redis = await create_pool(redis_settings(url))
        bench = Bench(url=url, where=where, redis=redis, prefix=prefix, home=home)
        try:
            yield bench
        finally:
            with contextlib.suppress(Exception):
                await bench.cleanup()
            await redis.aclose()
            if embedded is not None:
                await asyncio.to_thread(embedded.release)


async def command_counts(redis: ArqRedis) -> Counter[str]:
    """Calls per command since the server started (`INFO commandstats`)."""
    info = await redis.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items() if isinstance(v, dict)})


async def command_rate(redis: ArqRedis, seconds: float) -> tuple[float, Counter[str]]:
    """Commands per second the server executed over `seconds` (ours excluded: the two INFO calls)."""
    before = await command_counts(redis)
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    after = await command_counts(redis)
    wall = time.perf_counter() - t0
    delta = after - before
    delta["info"] = max(0, delta["info"] - 1)
    return sum(delta.values()) / wall, delta


# -- the scripted model ---------------------------------------------------------------------------

SHAPE = re.compile(r"bench-shape width=(\d+) chain=(\d+) steps=(\d+)")
BASELINE_SYSTEM = "You are a single ReAct agent (bench baseline)."


CHECKED = "Make each result machine-checkable."
# What a model asked for machine-checkable results writes in each task's `check`: the record was
# fetched, and the answer says it was reported (the bench executor's answer does).
TASK_CHECK = {"tools_called": ["fetch"], "pattern": r"^Record \S+ reported"}


def goal_text(width: int, chain: int, steps: int, checked: bool = False) -> str:
    """A goal whose plan is `width` independent chains of `chain` tasks, each a loop of `steps` tool
    calls and an answer; `checked`: it asks for machine-checkable results."""
    return f"Benchmark goal: bench-shape width={width} chain={chain} steps={steps}" + (f" {CHECKED}" if checked else "")


def task_id(i: int, j: int) -> str:
    return f"c{i}-t{j}"


def plan_for(width: int, chain: int, steps: int, checked: bool = False) -> dict[str, Any]:
    tasks = [
        {
            "id": task_id(i, j),
            "title": f"chain {i} task {j}",
            "instructions": f"Fetch record {i}-{j} with the fetch tool and report it." if steps else f"Report {i}-{j}.",
            "depends_on": [task_id(i, j - 1)] if j else [],
            "definition_of_done": f"record {i}-{j} is reported",
            "tools": ["fetch"] if steps else [],
            **({"check": TASK_CHECK} if checked and steps else {}),
        }
        for i in range(width)
        for j in range(chain)
    ]
    return {"tasks": tasks, "rationale": "bench"}


def role_of(req: RecordedRequest) -> str:
    """planner | review | goal_review | executor | baseline | unknown."""
    forced = (req.body.get("tool_choice") or {}).get("name")
    system = content_text(req.body.get("system"))
    offered = {t.get("name") for t in req.body.get("tools") or []}
    if system == PLANNER_SYSTEM and PLAN_TOOL in offered:
        return "planner"  # forced (a replan, a correction) or route first (the goal's tools beside it)
    if system == REVIEW_SYSTEM and not offered:
        return "review"
    if forced == FINAL_TOOL and system == FINAL_SYSTEM:
        return "goal_review"
    if system == EXECUTOR_SYSTEM:
        return "executor"
    if system == BASELINE_SYSTEM:
        return "baseline"
    return "unknown"


def tool_results(req: RecordedRequest) -> int:
    return sum(
        1
        for m in req.messages
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    )


ACCEPT = {"passed": True, "action": "accept", "feedback": "ok"}
FINAL = {"answer": "All records were reported.", "passed": True, "action": "accept", "feedback": "ok"}


class Responder:
    """Answers every role of taskloom (and the single-agent baseline) after `delay` seconds:
    the planner with the plan the goal text asks for, executors with `steps` tool calls then an
    answer, the critic with accept. Counts requests per role."""

    def __init__(self, delay: float = 0.0, jitter: float = 0.0) -> None:
        self.delay = delay
        self.jitter = jitter  # executor and review calls wait up to this much more, at random
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, req: RecordedRequest) -> Script:
        role = role_of(req)
        with self._lock:
            self.calls[role] += 1
        first = content_text(req.messages[0]["content"]) if req.messages else ""
        shape = SHAPE.search(first)
        width, chain, steps = (int(g) for g in shape.groups()) if shape else (1, 1, 1)
        d = self.delay
        if role in ("executor", "review") and self.jitter:
            d += random.uniform(0, self.jitter)
        if role == "planner":
            forced = (req.body.get("tool_choice") or {}).get("name") == PLAN_TOOL
            if width * chain == 1 and steps and not forced:
                # One task: a model offered the goal's tools beside submit_plan starts it itself.
                return tool_reply([("fetch", {"item": f"{task_id(0, 0)}-0"})], delay=d)
            return tool_reply([(PLAN_TOOL, plan_for(width, chain, steps, CHECKED in first))], delay=d)
        if role == "review":
            return text_reply(json.dumps(ACCEPT), delay=d)
        if role == "goal_review":
            return tool_reply([(FINAL_TOOL, FINAL)], delay=d)
        if role == "executor":
            done = tool_results(req)
            m = re.search(r"Your task \(([^)]+)\)", first)
            tid = m.group(1) if m else "?"
            if tid == "goal":  # a routed goal: the task is the goal's one chain
                tid = task_id(0, 0)
            if done < steps:
                return tool_reply([("fetch", {"item": f"{tid}-{done}"})], delay=d)
            return text_reply(f"Record {tid} reported after {done} fetches.", delay=d)
        if role == "baseline":
            return baseline_reply(req, d)
        return text_reply("unrouted request", delay=d)


LEAN = re.compile(r"lean items=(\S+)")


def baseline_reply(req: RecordedRequest, delay: float) -> Script:
    """The single ReAct agent of `bench.speedup`. Lean: one tool call per item, then one answer.
    Otherwise the latest user turn names the next task: a tool call, then a text once it is answered."""
    lean = LEAN.search(content_text(req.messages[0]["content"]))
    if lean:
        items = lean.group(1).split(",")
        done = tool_results(req)
        if done < len(items):
            return tool_reply([("fetch", {"item": items[done]})], delay=delay)
        return text_reply("All records were reported.", delay=delay)
    last = req.messages[-1]
    if isinstance(last["content"], list) and last["content"] and last["content"][0].get("type") == "tool_result":
        return text_reply("Reported the record.", delay=delay)
    m = re.search(r"fetch (\S+)", content_text(last["content"]))
    if m:
        return tool_reply([("fetch", {"item": m.group(1)})], delay=delay)
    return text_reply("All records were reported.", delay=delay)


# -- worker processes -----------------------------------------------------------------------------


def worker_env(bench: Bench, *, poll_delay: float, base_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "TASKLOOM_"))}
    env.update(
        TASKLOOM_REDIS_URL=bench.url,
        TASKLOOM_KEY_PREFIX=bench.prefix,
        TASKLOOM_POLL_DELAY=str(poll_delay),
        TASKLOOM_HOME=str(bench.home / "home"),
        TASKLOOM_MODEL=FAKE_MODEL,
        TASKLOOM_TOOLS=TOOLS,
        TASKLOOM_SHUTDOWN_GRACE="0",
        ANTHROPIC_API_KEY=FAKE_KEY,
        ANTHROPIC_BASE_URL=base_url,
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        PYTHONUNBUFFERED="1",
    )
    # The HTTP transport under the model SDK (TASKLOOM_HTTP_CLIENT): `BENCH_HTTP_CLIENT=httpx`
    # measures the SDK's own default against taskloom's (aiohttp); bench.floor follows it too.
    if os.environ.get("BENCH_HTTP_CLIENT"):
        env["TASKLOOM_HTTP_CLIENT"] = os.environ["BENCH_HTTP_CLIENT"]
    # `BENCH_GC_THRESHOLD=0` runs the workers with Python's own collector thresholds (TASKLOOM_GC_THRESHOLD),
    # for A/B runs; `BENCH_GC_PROBE=DIR` records every collection of theirs (bench/gcprobe).
    if os.environ.get("BENCH_GC_THRESHOLD"):
        env["TASKLOOM_GC_THRESHOLD"] = os.environ["BENCH_GC_THRESHOLD"]
    # `BENCH_SETTLE_DELAY=0` makes every model call settle on its own (TASKLOOM_LEDGER_SETTLE_DELAY),
    # for A/B runs against the executors' held settles.
    if os.environ.get("BENCH_SETTLE_DELAY"):
        env["TASKLOOM_LEDGER_SETTLE_DELAY"] = os.environ["BENCH_SETTLE_DELAY"]
    # `BENCH_EVENT_LOOP=asyncio` (or `uvloop`) runs the workers, the raw arq peer and bench.floor on that
    # loop (TASKLOOM_EVENT_LOOP; default: uvloop when installed), so that the floor is the workers' own.
    if os.environ.get("BENCH_EVENT_LOOP"):
        env["TASKLOOM_EVENT_LOOP"] = os.environ["BENCH_EVENT_LOOP"]
    # `BENCH_REDIS_SHARED_CONNECTION=false` gives the workers' every Redis command a pool connection of
    # its own (TASKLOOM_REDIS_SHARED_CONNECTION; default: the shared connection, bus.mux), for A/B runs.
    if os.environ.get("BENCH_REDIS_SHARED_CONNECTION"):
        env["TASKLOOM_REDIS_SHARED_CONNECTION"] = os.environ["BENCH_REDIS_SHARED_CONNECTION"]
    # `BENCH_HTTP_KEEPALIVE=5` keeps the workers' idle model connections for the SDKs' own 5 s instead of
    # taskloom's 30 (TASKLOOM_HTTP_KEEPALIVE), for A/B runs: bench.speedup pauses about 5 s between goals.
    if os.environ.get("BENCH_HTTP_KEEPALIVE"):
        env["TASKLOOM_HTTP_KEEPALIVE"] = os.environ["BENCH_HTTP_KEEPALIVE"]
    if os.environ.get("BENCH_GC_PROBE"):
        env["PYTHONPATH"] = os.pathsep.join((str(REPO / "bench" / "gcprobe"), env["PYTHONPATH"]))
    env.update(extra)
    return env


def worker_all_env(bench: Bench, *, poll_delay: float, base_url: str, concurrency: int) -> dict[str, str]:
    """`worker_env` for one `taskloom worker all` that runs `concurrency` tasks at once and reviews
    them all at once (bench.speedup, bench.critical): the critic has a slot for each task's review and
    one more for the final answer, which starts while the last reviews run. With only `concurrency`
    slots a goal of that width waits for a review to end before its final answer starts (width 20:
    160 ms from the last result to the final answer's start instead of 21, bench/RESULTS.md)."""
    return worker_env(
        bench,
        poll_delay=poll_delay,
        base_url=base_url,
        TASKLOOM_EXECUTOR_CONCURRENCY=str(concurrency),
        TASKLOOM_CRITIC_CONCURRENCY=str(max(10, concurrency + 1)),
    )


def spawn(args: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    try:
        return subprocess.Popen([sys.executable, *args], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    finally:
        out.close()


def spawn_worker(role: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`BENCH_PROFILE=DIR` in the environment runs the worker under cProfile (`bench._profiled`),
    switched on by `profile_from_now`, its stats written to DIR/<log name>.prof when it stops (print
    them with `python -m bench.profile DIR/*.prof`)."""
    profile = os.environ.get("BENCH_PROFILE")
    if profile:
        env = {**env, "BENCH_PROFILE_OUT": str(Path(profile) / f"{log.stem}.prof")}
        return spawn(["-m", "bench._profiled", "worker", role], env, log)
    return spawn(["-m", "taskloom", "worker", role], env, log)


# `BENCH_PYSPY=DIR`: py-spy samplers of the measured window, one per worker (pid -> sampler).
_samplers: dict[int, subprocess.Popen[bytes]] = {}


def profile_from_now(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Start the profilers of workers spawned under `BENCH_PROFILE` (the measured window begins).

    `BENCH_PYSPY=DIR` instead samples each worker with py-spy (`BENCH_PYSPY_RATE` per second, 100 by
    default; non-blocking, so nothing is added to the worker's CPU, unlike cProfile's cost per
    call) into DIR/<pid>.txt, as collapsed stacks: one line per stack, its sample count last
    (`python -m bench.profile --pyspy DIR/*.txt` prints the top entries)."""
    if os.environ.get("BENCH_PROFILE"):
        for p in procs:
            p.send_signal(signal.SIGUSR1)
    out = os.environ.get("BENCH_PYSPY")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        for p in procs:
            rate = os.environ.get("BENCH_PYSPY_RATE", "100")
            args = ["py-spy", "record", "--pid", str(p.pid), "--rate", rate, "--format", "raw", "--nonblocking"]
            args += ["--output", str(Path(out) / f"{p.pid}.txt")]
            _samplers[p.pid] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # py-spy attaches before the window's work begins


def profile_until_now(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """Stop the profilers of workers spawned under `BENCH_PROFILE` (the measured window ends)."""
    if os.environ.get("BENCH_PROFILE"):
        for p in procs:
            p.send_signal(signal.SIGUSR2)
    for p in procs:
        sampler = _samplers.pop(p.pid, None)
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            sampler.wait(30)


def stop(procs: Iterable[subprocess.Popen[bytes] | None]) -> None:
    """SIGTERM the processes we started (by pid), then SIGKILL any still alive after 10 s."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def wait_for_keys(
    redis: ArqRedis, keys: Iterable[str], procs: Iterable[subprocess.Popen[bytes]], timeout: float = 60
) -> None:
    """Until every key exists (a worker's health-check key: it has polled once)."""
    wanted = list(keys)
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all([await redis.exists(k) for k in wanted]):
            return
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a worker process exited early: {dead}")
        await asyncio.sleep(0.05)
    raise TimeoutError(f"workers not ready after {timeout} s: {wanted}")


def job_starts(log: Path) -> dict[str, datetime]:
    """job_id -> time of its `job.start` log line, from a worker's JSON log."""
    out: dict[str, datetime] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"job.start"' not in line:
            continue
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            out.setdefault(rec["job_id"], datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")))
    return out


# -- the raw arq worker (the peer), optionally with a wake-up signal ------------------------------

async def _noop(ctx: dict[str, Any], sent: float | None = None, out: str | None = None) -> None:
    """Does nothing; when `sent` is given, records (start - sent) seconds in the list `out`."""
    if sent is not None and out is not None:
        started = time.time()
        await ctx["redis"].rpush(out, f"{started - sent:.6f}")


def noop_worker(pool: ArqRedis, queue: str, poll_delay: float, max_jobs: int) -> Worker:
    """A plain arq worker with the same settings taskloom gives its workers (see taskloom.workers)."""
    return Worker(
        functions=[func(_noop, name="noop")],
        redis_pool=pool,
        queue_name=queue,
        poll_delay=poll_delay,
        max_jobs=max_jobs,
        keep_result=3600,
        health_check_interval=5,
        health_check_key=f"{queue}:health-check",
        handle_signals=False,
    )


async def wake_loop(worker: Worker, pool: ArqRedis, wake: ArqRedis, stream: str, fallback: float) -> None:
    """A prototype wake-up signal for arq (not in the product): poll the queue, then block on a
    stream that producers XADD to after each enqueue, for at most `fallback` seconds."""
    worker.ctx["redis"] = pool
    tail = await wake.xrevrange(stream, count=1)
    last: Any = tail[0][0] if tail else "0-0"
    while True:
        await worker._poll_iteration()
        reply = await wake.xread({stream: last}, count=100, block=max(1, int(fallback * 1000)))
        if reply:
            last = reply[0][1][-1][0]


async def _noop_main(args: argparse.Namespace) -> None:
    pool = await create_pool(redis_settings(args.redis_url))
    worker = noop_worker(pool, args.queue, args.poll_delay, args.max_jobs)
    if args.wake:
        wake = await create_pool(redis_settings(args.redis_url))
        await wake_loop(worker, pool, wake, args.wake, args.fallback)
    else:
        await worker.main()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._harness")
    sub = parser.add_subparsers(dest="command", required=True)
    noop = sub.add_parser("noop", help="run a raw arq worker with a no-op function")
    noop.add_argument("--redis-url", required=True)
    noop.add_argument("--queue", required=True)
    noop.add_argument("--poll-delay", type=float, default=0.05)
    noop.add_argument("--max-jobs", type=int, default=10)
    noop.add_argument("--wake", default="", help="stream to block on between polls (prototype wake-up)")
    noop.add_argument("--fallback", type=float, default=1.0, help="with --wake: longest block between polls")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(_noop_main(args))  # the workers' loop (TASKLOOM_EVENT_LOOP, from worker_env)


if __name__ == "__main__":
    main()
