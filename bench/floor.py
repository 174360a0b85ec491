"""The floor under a taskloom job: what the parts every job must use cost on their own, measured in a
process of their own, so that `bench.throughput` can set its targets beside what no change to
taskloom's own code can go below.

    python -m bench.floor --base-url URL [--redis-url redis://127.0.0.1:6379/0] [--calls 300]

The parts, each built exactly as a worker builds it (`taskloom.workers.build_runtime`):

- the Anthropic SDK: `calls` model calls through the worker's model adapter (the official
  `anthropic` client) against the Messages API at `--base-url`, 10 at a time as a worker with its
  default concurrency makes them; CPU seconds of this process per call;
- the ledger around each call: the same calls through the worker's metered model (reserve before,
  settle after, in a goal's books opened as a submitted goal's are); Redis commands per call
  (`INFO commandstats`, the commands a script runs included, as `bench.throughput` counts them);
- arq's enqueue of one job (`ArqRedis.enqueue_job`), in commands, so that `bench.throughput` can
  take it out of the raw arq peer's count and keep what arq's worker sends per job.

Prints one JSON object. Keys live under a fresh prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from arq import create_pool

from bench._harness import DEFAULT_REDIS, Bench, command_counts, fake_worker_settings, goal_text
from bus.connection import redis_settings
from executor.loop import SYSTEM
from executor.registry import ToolRegistry
from llm.types import Message, ModelRequest, ToolDef
from taskloom import eventloop
from taskloom.workers import build_runtime, make_inner_model, make_ledger

CONCURRENCY = 10  # a worker's default concurrency


@dataclass(frozen=True)
class Floor:
    sdk_cpu_ms_per_call: float  # the model adapter alone (the SDK's request, HTTP and parse)
    metered_cpu_ms_per_call: float  # the same call through the ledger
    ledger_commands_per_call: float  # reserve + settle
    enqueue_commands_per_job: float  # arq's enqueue_job


def request() -> ModelRequest:
    """An executor's first request in `bench.throughput` (its task text, its one tool)."""
    text = f"Goal: {goal_text(4, 1, 1)}\nYour task (c0-t0): chain 0 task 0\nInstructions: Fetch record 0-0."
    fetch = ToolDef(
        name="fetch",
        description="Fetch one record by its id.",
        input_schema={"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
    )
    return ModelRequest(system=SYSTEM, messages=[Message.user(text)], tools=[fetch], max_tokens=1024)


WARM_UP = 20


async def _timed(calls: int, call: Callable[[], Awaitable[object]]) -> float:
    """CPU seconds of this process per `call()`, CONCURRENCY at a time, after WARM_UP calls."""

    async def lane(n: int) -> None:
        for _ in range(n):
            await call()

    await lane(WARM_UP)
    t0 = time.process_time()
    await asyncio.gather(*(lane(calls // CONCURRENCY) for _ in range(CONCURRENCY)))
    return (time.process_time() - t0) / (calls // CONCURRENCY * CONCURRENCY)


async def measure(redis_url: str, base_url: str, calls: int) -> Floor:
    prefix = f"bench-floor-{uuid.uuid4().hex[:10]}:"
    settings = fake_worker_settings(redis_url, base_url, prefix)
    redis = await create_pool(redis_settings(redis_url))
    bench = Bench(url=redis_url, where=redis_url, redis=redis, prefix=prefix, home=Path.cwd())  # for its cleanup
    inner = make_inner_model(settings)
    try:
        rt = build_runtime(settings, redis, inner, ToolRegistry())
        goal_id = f"g-{uuid.uuid4().hex[:12]}"
        await make_ledger(settings, redis).open(goal_id, 10**12, tenant="default")  # as `Client.submit` opens it
        req = request()
        sdk = await _timed(calls, lambda: inner.complete(req))
        metered = rt.model_for(goal_id)
        before = await command_counts(redis)
        cpu = await _timed(calls, lambda: metered.complete(req))
        made = calls // CONCURRENCY * CONCURRENCY + WARM_UP
        ledger = (sum((await command_counts(redis) - before).values()) - 1) / made  # the INFO itself not counted
        queue = f"{prefix}floor-queue"
        before = await command_counts(redis)
        for i in range(100):
            await redis.enqueue_job("noop", _queue_name=queue, _job_id=f"{prefix}floor-{i}")
        enqueue = (sum((await command_counts(redis) - before).values()) - 1) / 100
        return Floor(sdk * 1000, cpu * 1000, ledger, enqueue)
    finally:
        close = getattr(inner, "aclose", None)
        if close is not None:
            await close()
        await bench.cleanup()
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--base-url", required=True, help="the Messages API to call (a fake one)")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    floor = eventloop.run(measure(args.redis_url, args.base_url, args.calls))  # the workers' loop
    print(json.dumps(asdict(floor)))


if __name__ == "__main__":
    main()
