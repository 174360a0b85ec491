"""Token growth: input tokens sent per step over a long tool loop with large observations, with the
observation limit, history compaction and prompt caching on and off.

    python -m bench.tokens [--redis-url redis://127.0.0.1:6379/0] [--steps 30] [--observation 12000]

The executor's own ReAct loop (`executor.loop.Loop`, with its Redis checkpoints and tool gateway)
runs one task of `--steps` tool calls, each observation `--observation` characters, then an answer,
against the fake Messages API, which counts tokens like `llm/testing/tokens.py` (4 bytes a token)
and simulates prompt caching (`cache_min_tokens`, default 1024 as for Claude Sonnet; a fresh server
per configuration, so no configuration reads another's cache). Limits: `tool_output_limit` (4000
characters, the default) and `compact_after_tokens` (20,000 estimated tokens, the default: older
observations are condensed to 200 characters, the last 2 turns are kept). Caching: the request's
`cache` flag (on by default in the executor; the Anthropic adapter then marks the tools, the
system prompt and the latest user turn).

Per step: input tokens of the request = uncached + cache read + cache write. The peer figure is the
first row, measured in the same run: no limit, no compaction, no caching. Keys live under a unique
prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from bench._harness import DEFAULT_REDIS, FAKE_KEY, FAKE_MODEL, Bench, Responder, bench_redis, goal_text, machine
from bus.attempts import AttemptStore
from bus.events import EventLog
from bus.runtime import Limits
from bus.schemas import Goal, GoalRecord, TaskSpec
from executor.gateway import ToolGateway
from executor.loop import Loop, TaskInput
from executor.pipeline import Attempt, History
from executor.registry import load_registry
from llm.anthropic import AnthropicModel
from llm.port import ModelPort
from llm.testing import FakeAnthropicServer
from llm.types import ModelRequest, ModelResponse, Usage
from taskloom.logs import configure_logging

NEVER = 10**9


@dataclass(frozen=True)
class Config:
    name: str
    output_limit: int
    compact_after: int
    cache: bool


CONFIGS = (
    Config("no limit, no compaction, no cache (peer)", NEVER, NEVER, False),
    Config("output limit 4000 chars", 4000, NEVER, False),
    Config("limit + compaction (20k)", 4000, 20_000, False),
    Config("limit + caching", 4000, NEVER, True),
    Config("limit + compaction + caching (defaults)", 4000, 20_000, True),
)


class CacheSwitch:
    """A ModelPort that sets each request's `cache` flag."""

    def __init__(self, inner: AnthropicModel, cache: bool) -> None:
        self.inner = inner
        self.cache = cache
        self.name = inner.name
        self.model = inner.model

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await self.inner.complete(request.model_copy(update={"cache": self.cache}))


async def never_cancelled() -> bool:
    return False


async def one_loop(bench: Bench, config: Config, steps: int, cache_min: int) -> list[Usage]:
    """Run one task of `steps` tool calls and an answer; the usage of every model call, in order."""
    gid = uuid.uuid4().hex
    goal = GoalRecord(id=gid, goal=Goal(text=goal_text(1, 1, steps)), budget_tokens=10**8)
    spec = TaskSpec(
        id="c0-t0",
        title="fetch many records",
        instructions=f"Fetch {steps} records with the fetch tool, one per turn, then summarise them.",
        definition_of_done="every record is summarised",
        tools=["fetch"],
    )
    limits = Limits(
        max_steps=steps + 2,
        tool_output_limit=config.output_limit,
        compact_after_tokens=config.compact_after,
        loop_window=8,
    )
    store = AttemptStore(bench.redis, bench.keys, gid, spec.id, 1)
    if not await store.acquire("bench-tokens", 600):
        raise RuntimeError("could not take the attempt's lease")
    gateway = ToolGateway(
        load_registry("bench.toolkit:kit"),
        {"fetch"},
        EventLog(bench.redis, bench.keys),
        output_limit=config.output_limit,
        attempt=Attempt(goal_id=gid, task_id=spec.id, attempt=1, store=store, history=History()),
        loop_window=limits.loop_window,
    )
    with FakeAnthropicServer(cache_min_tokens=cache_min) as fake:
        fake.respond_with(Responder(delay=0.0))
        inner = AnthropicModel(FAKE_MODEL, api_key=FAKE_KEY, base_url=fake.base_url)
        model: ModelPort = CacheSwitch(inner, config.cache)
        try:
            loop = Loop(
                TaskInput(goal=goal, spec=spec, attempt=1), store, model, gateway, limits, never_cancelled
            )
            result = await loop.run()
        finally:
            await inner.aclose()
    if result.stop_reason != "answered" or result.tool_calls != steps:
        raise RuntimeError(f"{config.name}: the loop stopped with {result.stop_reason} after {result.tool_calls} calls")
    return [s.usage for s in await store.steps()]


def weighted(usages: list[Usage]) -> float:
    return sum(u.input_tokens + 0.1 * u.cache_read_tokens + 1.25 * u.cache_write_tokens for u in usages)


def sent(u: Usage) -> int:
    return u.input_tokens + u.cache_read_tokens + u.cache_write_tokens


async def run(url: str, steps: int, observation: int, cache_min: int) -> str:
    previous = os.environ.get("BENCH_OBSERVATION_CHARS")
    os.environ["BENCH_OBSERVATION_CHARS"] = str(observation)
    try:
        async with bench_redis(url, "tokens") as bench:
            where = await machine(bench.redis, bench.where)
            rows = [(c, await one_loop(bench, c, steps, cache_min)) for c in CONFIGS]
    finally:
        if previous is None:
            os.environ.pop("BENCH_OBSERVATION_CHARS", None)
        else:
            os.environ["BENCH_OBSERVATION_CHARS"] = previous
    return report(where, steps, observation, cache_min, rows)


def report(where: str, steps: int, observation: int, cache_min: int, rows: list[tuple[Config, list[Usage]]]) -> str:
    marks = sorted({1, *range(5, steps + 1, 5), steps, steps + 1})
    peer_total = sum(sent(u) for u in rows[0][1])
    lines = [
        where,
        f"{steps} tool steps + 1 answer, each observation {observation:,} characters; fake server cache floor "
        f"{cache_min} tokens",
        "",
        "Input tokens sent per model call (uncached + cache read + cache write), at call n:",
        "",
        "| configuration | " + " | ".join(f"n={n}" for n in marks) + " | total input | vs peer | read from cache "
        "| cache written | uncached | price-weighted input vs peer |",
        "| --- | " + " | ".join("---:" for _ in marks) + " | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config, usages in rows:
        total = sum(sent(u) for u in usages)
        read = sum(u.cache_read_tokens for u in usages)
        written = sum(u.cache_write_tokens for u in usages)
        fresh = sum(u.input_tokens for u in usages)
        curve = " | ".join(f"{sent(usages[n - 1]):,}" if n <= len(usages) else "-" for n in marks)
        lines.append(
            f"| {config.name} | {curve} | {total:,} | {total / peer_total:.2f} | {read / total:.0%} | "
            f"{written / total:.0%} | {fresh / total:.0%} | {weighted(usages) / peer_total:.3f} |"
        )
    lines += [
        "",
        "price-weighted: uncached x 1, cache read x 0.1, cache write x 1.25 (Anthropic's multipliers for 5-minute "
        "caching), relative to the peer's input.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--steps", type=int, default=30, help="tool calls before the answer")
    parser.add_argument("--observation", type=int, default=12_000, help="characters each tool call returns")
    parser.add_argument("--cache-min-tokens", type=int, default=1024, help="the fake server's cacheable prefix floor")
    args = parser.parse_args()
    configure_logging("WARNING", json=True, stream=sys.stderr)  # the loop logs every tool call
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = asyncio.run(run(args.redis_url, args.steps, args.observation, args.cache_min_tokens))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
