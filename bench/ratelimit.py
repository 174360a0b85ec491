"""Fleet-wide rate limits: 50 goals on 3 executor processes against a provider that enforces
requests/min and tokens/min with 429s, with taskloom's limiter set to the provider's limits, then
without it.

    python -m bench.ratelimit [--redis-url redis://127.0.0.1:6379/0] [--goals 50] [--minutes 1.0]

The fake Messages API (in this process) enforces rpm, input tokens/min and output tokens/min as
token buckets holding one minute's allowance (as Anthropic's do), answering 429 with `retry-after`
past them. Each goal is a one-task plan without tools: 5 model calls (plan, execute, review, goal
review, answer), answered after `--delay` s. The limits are scaled to the workload so the run is
short: a warm-up goal measures the average call, then the input tokens/min limit is set so the
whole demand takes about `--minutes` minutes past the first (full) minute's bucket; rpm and output
tokens/min are set 50% above what that pace needs, so input tokens/min is the binding limit.

Reported per run: 429s the provider sent, goal makespan (first submit to last goal ended), and the
achieved rate of the binding limit as a fraction of it, *sustained*: what the provider admitted
minus the bucket's initial allowance, over the time from the first admitted call to the last (and
the plain averages of every limit). Without the
limiter, 429s are retried by the SDK (2 retries honouring retry-after) and then by the job layer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from bench._harness import (
    DEFAULT_REDIS,
    FAKE_MODEL,
    Bench,
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
from llm.testing import FakeAnthropicServer
from llm.testing.server import ProviderLimits

CALLS_PER_GOAL = 5


@dataclass(frozen=True)
class Run:
    limiter: bool
    makespan: float
    throttled: int
    succeeded: int
    goals: int
    fractions: dict[str, float]
    waited_events: int


async def one_run(
    bench: Bench, goals: int, limits: ProviderLimits | None, limiter: bool, delay: float, tag: str
) -> tuple[Run | None, list[tuple[float, int, int]], int]:
    """Run `goals` goals; returns the run's numbers (None for the warm-up), the admitted calls and
    the output tokens billed."""
    with FakeAnthropicServer(limits=limits) as fake:
        fake.respond_with(Responder(delay=delay))
        extra = {"TASKLOOM_EXECUTOR_CONCURRENCY": "10"}
        if limiter and limits is not None:
            mine = {"rpm": limits.rpm, "input_tpm": limits.input_tpm, "output_tpm": limits.output_tpm}
            extra["TASKLOOM_RATE_LIMITS"] = json.dumps({FAKE_MODEL: mine})
        env = worker_env(bench, poll_delay=0.05, base_url=fake.base_url, **extra)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for role in ["planner", "critic", "executor", "executor", "executor"]:
                procs.append(spawn_worker(role, env, bench.home / f"{tag}-{role}-{len(procs)}.log"))
            await wait_for_keys(
                bench.redis, [bench.keys.health_check(r) for r in ("planner", "executor", "critic")], procs, 180
            )
            await asyncio.sleep(2.0)  # every executor up (they share one health-check key)
            client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
            t0 = time.perf_counter()
            ids = await asyncio.gather(*(client.submit(goal_text(1, 1, 0)) for _ in range(goals)))
            records = await asyncio.gather(*(client.wait(gid, timeout=900) for gid in ids))
            makespan = time.perf_counter() - t0
            waited = 0
            for gid in ids:
                waited += sum(1 for e in await client.log.read(gid) if e.type == "model.rate_limited")
        finally:
            stop(procs)
        admitted = list(fake.admitted)
        output = fake.billed.output_tokens
        throttled = fake.throttled
    ok = sum(r.state.value == "succeeded" for r in records)
    if limits is None:
        return None, admitted, output
    span = (admitted[-1][0] - admitted[0][0]) / 60 if len(admitted) > 1 else float("nan")
    total_in = sum(i for _, i, _ in admitted)

    def sustained(total: float, per_minute: int) -> float:
        return (total - per_minute) / span / per_minute if per_minute else float("nan")

    def average(total: float, per_minute: int) -> float:
        return total / span / per_minute if per_minute else float("nan")

    fractions = {
        "input tokens/min": sustained(total_in, limits.input_tpm),
        "input tokens/min, average": average(total_in, limits.input_tpm),
        "requests/min": average(len(admitted), limits.rpm),
        "output tokens/min": average(output, limits.output_tpm),
    }
    return Run(limiter, makespan, throttled, ok, goals, fractions, waited), admitted, output


async def run(url: str, goals: int, minutes: float, delay: float) -> str:
    async with bench_redis(url, "ratelimit") as bench:
        where = await machine(bench.redis, bench.where)
        _, warm, warm_out = await one_run(bench, 2, None, False, delay, "warmup")
        calls = len(warm)
        avg_in = sum(i for _, i, _ in warm) / calls
        avg_out = warm_out / calls
        avg_max = sum(m for _, _, m in warm) / calls
        demand_calls = goals * CALLS_PER_GOAL
        # Input binds: the whole demand takes ~`minutes` past the first minute's full bucket.
        itpm = int(demand_calls * avg_in / (1 + minutes))
        pace = demand_calls / (1 + minutes)  # calls per minute at that limit
        limits = ProviderLimits(
            rpm=int(pace * 1.5) + 1,
            input_tpm=itpm,
            # Output is counted as max_tokens when a call starts: room for 1.5x the pace at max_tokens.
            output_tpm=int(pace * max(avg_max, avg_out) * 1.5),
        )
        runs = []
        for limiter in (True, False):
            r, _, _ = await one_run(bench, goals, limits, limiter, delay, "with" if limiter else "without")
            assert r is not None
            runs.append(r)
    return report(where, goals, delay, limits, avg_in, avg_out, runs)


def report(
    where: str, goals: int, delay: float, limits: ProviderLimits, avg_in: float, avg_out: float, runs: list[Run]
) -> str:
    lines = [
        where,
        f"{goals} goals (one task, {CALLS_PER_GOAL} model calls each) on 3 executor processes (+1 planner, +1 "
        f"critic, concurrency 10 each); fake API answers after {delay:g} s and enforces rpm {limits.rpm}, "
        f"input tokens/min {limits.input_tpm:,}, output tokens/min {limits.output_tpm:,} (average call: "
        f"{avg_in:.0f} input, {avg_out:.0f} output tokens)",
        "",
        "| taskloom limiter | 429s received | goals succeeded | makespan s | input tokens/min, sustained "
        "(binding) | input tokens/min, average | requests/min, average | output tokens/min, average "
        "| calls that waited (events) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        f = r.fractions
        lines.append(
            f"| {'on, = provider limits' if r.limiter else 'off'} | {r.throttled} | {r.succeeded}/{r.goals} | "
            f"{r.makespan:.1f} | {f['input tokens/min']:.2f} | {f['input tokens/min, average']:.2f} | "
            f"{f['requests/min']:.2f} | {f['output tokens/min']:.2f} | {r.waited_events} |"
        )
    lines.append("")
    lines.append(
        "Fractions of each limit over the span from the first to the last admitted call. Sustained: "
        "(admitted - the bucket's initial one minute's allowance) / span / limit, the pace the limit "
        "allows once the first full bucket is spent. Average: admitted / span / limit (includes the "
        "initial burst). Only input tokens/min binds; the other limits are set 50% above the pace."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--goals", type=int, default=50)
    parser.add_argument("--minutes", type=float, default=1.0, help="how long the demand takes past the first minute")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds the fake takes per answer")
    args = parser.parse_args()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = asyncio.run(run(args.redis_url, args.goals, args.minutes, args.delay))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
