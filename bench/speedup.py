"""Parallel speed-up: makespan of DAGs of width 1, 2, 4, 8 with a model answering after a fixed delay,
beside the critical-path lower bound and a single ReAct loop running the same tasks one after another.

    python -m bench.speedup [--redis-url redis://127.0.0.1:6379/0] [--delay 0.2] [--widths 1,2,4,8] [--reps 3]

One `taskloom worker all` process (executor concurrency `--concurrency`, default 8) runs goals whose
plan is `width` independent tasks, each a 2-step tool loop (a `fetch` tool call, then the answer),
against the fake Messages API answering every call after `--delay` s. Makespan: submit -> goal
succeeded (median of `--reps`). Critical-path lower bound: the model delays along the longest path,
i.e. planner 1 + executor 2 + task review 1 + final answer 1 + goal review 1 = 6 calls, whatever the
width. The peers, in the same run, on the same fake server with the same delay, in this process:

- single ReAct loop, same tasks: one conversation running each task's 2 steps one after another
  (2 x width calls), with no planner and no critic;
- lean ReAct: one conversation calling the `width` tools one per turn, then answering once
  (width + 1 calls): the ReAct baseline of the LLMCompiler paper.

Keys live under a unique prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import UTC, datetime

from bench._harness import (
    BASELINE_SYSTEM,
    DEFAULT_REDIS,
    FAKE_KEY,
    FAKE_MODEL,
    Responder,
    bench_redis,
    goal_text,
    machine,
    spawn_worker,
    stop,
    task_id,
    wait_for_keys,
    worker_env,
)
from bench.toolkit import observation
from bus.client import Client
from llm.anthropic import AnthropicModel
from llm.testing import FakeAnthropicServer
from llm.types import Message, ModelRequest, ToolDef, ToolResultBlock

STEPS = 1  # tool calls per task before its answer: a 2-step tool loop
FETCH = ToolDef(
    name="fetch",
    description="Fetch one record by its id.",
    input_schema={"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
)


def critical_calls(steps: int = STEPS) -> int:
    """Model calls on the longest path: plan, the task's steps + answer, its review, final answer, goal review."""
    return 1 + (steps + 1) + 1 + 1 + 1


async def react_same_tasks(model: AnthropicModel, width: int) -> tuple[float, int]:
    """One conversation, each task's tool call and answer one after another: (seconds, calls)."""
    calls = 0
    messages: list[Message] = []
    t0 = time.perf_counter()
    for i in range(width):
        messages.append(Message.user(f"Next task: fetch {task_id(i, 0)} and report it."))
        calls += await _converse(model, messages)
    return time.perf_counter() - t0, calls


async def react_lean(model: AnthropicModel, width: int) -> tuple[float, int]:
    """One conversation calling one tool per turn, then answering once: (seconds, calls)."""
    items = ",".join(task_id(i, 0) for i in range(width))
    messages = [Message.user(f"Fetch and report every record. lean items={items}")]
    t0 = time.perf_counter()
    calls = await _converse(model, messages)
    return time.perf_counter() - t0, calls


async def _converse(model: AnthropicModel, messages: list[Message]) -> int:
    """Call the model, answer its tool calls, repeat until it answers; return the number of calls."""
    calls = 0
    while True:
        response = await model.complete(
            ModelRequest(system=BASELINE_SYSTEM, messages=messages, tools=[FETCH], max_tokens=1024)
        )
        calls += 1
        messages.append(response.as_message())
        if not response.tool_uses:
            return calls
        results = [
            ToolResultBlock(tool_use_id=u.id, content=observation(str(u.input["item"]), 200))
            for u in response.tool_uses
        ]
        messages.append(Message(role="user", content=list(results)))


async def run(url: str, delay: float, widths: list[int], reps: int, concurrency: int, poll_delay: float) -> str:
    async with bench_redis(url, "speedup") as bench:
        where = await machine(bench.redis, bench.where)
        responder = Responder(delay=delay)
        rows = []
        with FakeAnthropicServer() as fake:
            fake.respond_with(responder)
            model = AnthropicModel(FAKE_MODEL, api_key=FAKE_KEY, base_url=fake.base_url)
            env = worker_env(
                bench,
                poll_delay=poll_delay,
                base_url=fake.base_url,
                TASKLOOM_EXECUTOR_CONCURRENCY=str(concurrency),
                TASKLOOM_CRITIC_CONCURRENCY=str(max(10, concurrency)),
            )
            proc = spawn_worker("all", env, bench.home / "worker.log")
            try:
                await wait_for_keys(
                    bench.redis, [bench.keys.health_check(r) for r in ("planner", "executor", "critic")], [proc]
                )
                client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
                await goal(client, 1)  # warm-up: imports, connections, scripts
                await react_lean(model, 1)
                for width in widths:
                    spans, same, lean = [], [], []
                    calls = 0
                    for _ in range(reps):
                        before = len(fake.message_requests)
                        spans.append(await goal(client, width))
                        calls = len(fake.message_requests) - before
                        same.append(await react_same_tasks(model, width))
                        lean.append(await react_lean(model, width))
                    rows.append((width, calls, spans, same, lean))
            finally:
                stop([proc])
                await model.aclose()
    return report(where, delay, reps, concurrency, poll_delay, rows)


async def goal(client: Client, width: int) -> float:
    t0 = time.perf_counter()
    gid = await client.submit(goal_text(width, 1, STEPS))
    record = await client.wait(gid, timeout=120)
    if record.state.value != "succeeded":
        raise RuntimeError(f"goal {gid} ended {record.state.value}: {record.reason}")
    return time.perf_counter() - t0


def report(
    where: str,
    delay: float,
    reps: int,
    concurrency: int,
    poll_delay: float,
    rows: list[tuple[int, int, list[float], list[tuple[float, int]], list[tuple[float, int]]]],
) -> str:
    bound = critical_calls() * delay
    lines = [
        where,
        f"model delay {delay * 1000:.0f} ms per call; one `taskloom worker all` process, executor concurrency "
        f"{concurrency}, poll delay {poll_delay:g} s; median of {reps} runs per width",
        "",
        "| width | taskloom model calls | critical path (calls) | lower bound s | makespan s | makespan / bound "
        "| single ReAct loop, same tasks s (calls) | speed-up | lean ReAct s (calls) | speed-up vs lean |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for width, calls, spans, same, lean in rows:
        span = statistics.median(spans)
        s_same = statistics.median(t for t, _ in same)
        s_lean = statistics.median(t for t, _ in lean)
        lines.append(
            f"| {width} | {calls} | {critical_calls()} | {bound:.2f} | {span:.2f} | {span / bound:.2f} | "
            f"{s_same:.2f} ({same[0][1]}) | {s_same / span:.2f}x | {s_lean:.2f} ({lean[0][1]}) | {s_lean / span:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds the fake model takes per call")
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="TASKLOOM_EXECUTOR_CONCURRENCY (>= the widest DAG)")
    parser.add_argument("--poll-delay", type=float, default=0.05)
    args = parser.parse_args()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    widths = [int(w) for w in args.widths.split(",")]
    table = asyncio.run(run(args.redis_url, args.delay, widths, args.reps, args.concurrency, args.poll_delay))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
