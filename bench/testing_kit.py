"""How long `taskloom.testing.run_goal` takes for the `taskloom demo` goal with the demo model.

    python -m bench.testing_kit [--runs 20] [--redis-url redis://127.0.0.1:6379/0]

Target: under 0.5 s per run on this machine (the issue's figure). Measured in one process, in turn:

* `run_goal` on fakeredis with `DemoModel(latency=0)` (the kit's default model): the first run in the
  process (it pays fakeredis' Lua runtime and first-use costs) and `--runs` more;
* the same with the demo model's simulated 30 ms per call (as `taskloom demo` runs it), where about
  0.36 s of the run is that simulated latency along the critical path;
* the peer: the same in-process fleet (`InProcessFleet`) on a real Redis server (`--redis-url`, or an
  embedded redis-server when it cannot be reached), zero latency.

Each run is timed from submit to settled (nothing queued or running), start-up and shutdown of the
fleet included. Logs go to a null stream, as pytest would capture them.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import structlog

from bench._harness import bench_redis, machine
from bus.schemas import Goal, GoalState
from llm.demo import DemoModel
from taskloom.cli import DEMO_DOD, DEMO_GOAL
from taskloom.settings import load_settings
from taskloom.testing import RunResult, run_goal

GOAL = Goal(text=DEMO_GOAL, definition_of_done=DEMO_DOD, budget_tokens=100_000)


async def timed(run: Callable[[], Awaitable[RunResult]]) -> float:
    started = time.perf_counter()
    result = await run()
    seconds = time.perf_counter() - started
    if result.state is not GoalState.SUCCEEDED:
        raise SystemExit(f"the demo goal ended {result.state.value}: {result.summary()}")
    return seconds


def row(name: str, seconds: list[float]) -> str:
    q = statistics.quantiles(seconds, n=10, method="inclusive") if len(seconds) > 1 else seconds * 9
    return (
        f"| {name} | {len(seconds)} | {statistics.median(seconds) * 1000:.0f} | {q[8] * 1000:.0f} | "
        f"{min(seconds) * 1000:.0f} | {max(seconds) * 1000:.0f} |"
    )


async def run(runs: int, redis_url: str) -> str:
    fast, slow = DemoModel(latency=0), DemoModel()
    first = await timed(lambda: run_goal(GOAL, model=fast))
    warm = [await timed(lambda: run_goal(GOAL, model=fast)) for _ in range(runs)]
    latency = [await timed(lambda: run_goal(GOAL, model=slow)) for _ in range(runs)]
    async with bench_redis(redis_url, "testing-kit") as bench:
        settings = load_settings(poll_delay=0.05, key_prefix=bench.prefix)
        real = [
            await timed(lambda: run_goal(GOAL, model=fast, settings=settings, redis=bench.redis)) for _ in range(runs)
        ]
        where = await machine(bench.redis, bench.where)
    lines = [
        f"Machine: {where}. Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        "| run_goal, demo goal (4 tasks, 1 critic retry, 17 model calls) | runs | p50 ms | p90 ms | min ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        row("fakeredis, DemoModel(latency=0), first run in the process", [first]),
        row("fakeredis, DemoModel(latency=0)", warm),
        row("fakeredis, DemoModel() (30 ms per call, as `taskloom demo`)", latency),
        row("peer: same fleet on a real Redis server, DemoModel(latency=0)", real),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(io.StringIO()))
    logging.getLogger().handlers[:] = [logging.NullHandler()]
    print(asyncio.run(run(args.runs, args.redis_url)))


if __name__ == "__main__":
    main()
