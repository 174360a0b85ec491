"""Parallel speed-up: makespan of DAGs of width 1, 2, 4, 8 with a model answering after a fixed delay,
beside the critical-path lower bound and a single ReAct loop running the same tasks one after another,
and the tokens each spends.

    python -m bench.speedup [--redis-url redis://127.0.0.1:6379/0] [--delay 0.2] [--widths 1,2,4,8] [--reps 3]

One `taskloom worker all` process (executor concurrency `--concurrency`, default 8) runs goals of
`width` independent tasks, each a 2-step tool loop (a `fetch` tool call, then the answer), against
the fake Messages API answering every call after `--delay` s. The scripted model plays a model
offered the goal's tools beside `submit_plan` (route first): for a goal of one task it calls `fetch`
itself, for a wider one it submits the plan. Two review configurations per width:

- model review (the default, `every_task`): the critic's model judges every task; a one-task goal's
  review is its goal review; a wider goal's final answer and its verdict are one critic call,
  started while the last task reviews run;
- machine check: the goal asks for machine-checkable results, and the planner gives each task a
  `check` (`fetch` was called, the answer matches `^Record \\S+ reported`); at width 1 the goal
  carries that check (its one task is the goal). The critic decides those without a model call.

Makespan: submit -> goal succeeded (median of `--reps`). Critical-path lower bound: the model delays
along the longest path. Width 1: plan (the planner's call is the task's first step) + the answer
+ the review = 3 calls (2 with a machine check). Wider: plan 1 + task steps 2 + max(task review,
final answer with its verdict) 1 = 4 calls, whatever the width. Tokens: billed input (cache reads
and writes included) and output per goal, from the goal's ledger, and from the usage the fake
server reports for the single loop. The peers, in the same run, on the same fake server with the
same delay, in this process:

- single ReAct loop, same tasks: one conversation running each task's 2 steps one after another
  (2 x width calls), with no planner and no critic;
- lean ReAct: one conversation calling the `width` tools one per turn, then answering once
  (width + 1 calls): the ReAct baseline of the LLMCompiler paper.

The report ends with issue 13's targets (issue 32's for the speed-up: the same figures, on a 2-core
machine), each marked met or not per review configuration, from the rows of the same run; then the
worker's CPU per goal beside the floor of its model calls (`bench.floor`, run last) and what is
left, taskloom's own. Keys live under a unique prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from bench._harness import (
    BASELINE_SYSTEM,
    DEFAULT_REDIS,
    FAKE_KEY,
    FAKE_MODEL,
    TASK_CHECK,
    Responder,
    bench_redis,
    goal_text,
    machine,
    profile_from_now,
    spawn_worker,
    stop,
    task_id,
    wait_for_keys,
    worker_all_env,
)
from bench.floor import Floor
from bench.throughput import cpu_seconds, floor
from bench.toolkit import observation
from bus.client import Client
from llm.anthropic import AnthropicModel
from llm.testing import FakeAnthropicServer
from llm.types import Message, ModelRequest, ToolDef, ToolResultBlock, Usage

STEPS = 1  # tool calls per task before its answer: a 2-step tool loop
FETCH = ToolDef(
    name="fetch",
    description="Fetch one record by its id.",
    input_schema={"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
)


CONFIGS = ("model review", "machine check")


def critical_calls(width: int, machine: bool = False, steps: int = STEPS) -> int:
    """Model calls on the longest path. One task: the planner's call is its first step, then the rest of
    its steps and the answer, then its review (none with a machine check). Wider: plan, the task's steps
    and answer, then the task review and the final answer with its verdict side by side."""
    if width == 1:
        return steps + 1 + (0 if machine else 1)
    return 1 + (steps + 1) + 1


@dataclass
class Tokens:
    input: int = 0
    output: int = 0

    def add(self, usage: Usage) -> None:
        self.input += usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
        self.output += usage.output_tokens

    @property
    def total(self) -> int:
        return self.input + self.output

    def __str__(self) -> str:
        return f"{self.input:,} + {self.output:,}"


@dataclass
class Row:
    width: int
    config: str
    calls: int = 0
    spans: list[float] = field(default_factory=list)
    tokens: Tokens = field(default_factory=Tokens)
    same: list[tuple[float, int]] = field(default_factory=list)
    same_tokens: Tokens = field(default_factory=Tokens)
    lean: list[tuple[float, int]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # the worker's CPU seconds during each goal


async def react_same_tasks(model: AnthropicModel, width: int, tokens: Tokens | None = None) -> tuple[float, int]:
    """One conversation, each task's tool call and answer one after another: (seconds, calls)."""
    calls = 0
    messages: list[Message] = []
    t0 = time.perf_counter()
    for i in range(width):
        messages.append(Message.user(f"Next task: fetch {task_id(i, 0)} and report it."))
        calls += await _converse(model, messages, tokens)
    return time.perf_counter() - t0, calls


async def react_lean(model: AnthropicModel, width: int) -> tuple[float, int]:
    """One conversation calling one tool per turn, then answering once: (seconds, calls)."""
    items = ",".join(task_id(i, 0) for i in range(width))
    messages = [Message.user(f"Fetch and report every record. lean items={items}")]
    t0 = time.perf_counter()
    calls = await _converse(model, messages)
    return time.perf_counter() - t0, calls


async def _converse(model: AnthropicModel, messages: list[Message], tokens: Tokens | None = None) -> int:
    """Call the model, answer its tool calls, repeat until it answers; return the number of calls."""
    calls = 0
    while True:
        response = await model.complete(
            ModelRequest(system=BASELINE_SYSTEM, messages=messages, tools=[FETCH], max_tokens=1024)
        )
        calls += 1
        if tokens is not None:
            tokens.add(response.usage)
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
        rows: list[Row] = []
        with FakeAnthropicServer() as fake:
            fake.respond_with(responder)
            model = AnthropicModel(FAKE_MODEL, api_key=FAKE_KEY, base_url=fake.base_url)
            env = worker_all_env(bench, poll_delay=poll_delay, base_url=fake.base_url, concurrency=concurrency)
            proc = spawn_worker("all", env, bench.home / "worker.log")
            try:
                await wait_for_keys(
                    bench.redis, [bench.keys.health_check(r) for r in ("planner", "executor", "critic")], [proc]
                )
                client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
                for warm in (1, 2):  # imports, connections, scripts; both paths (routed and planned)
                    await goal(client, warm, False)
                await react_lean(model, 1)
                profile_from_now([proc])
                for width in widths:
                    for config in CONFIGS:
                        row = Row(width, config)
                        for rep in range(reps):
                            before = len(fake.message_requests)
                            cpu0 = cpu_seconds([proc])
                            span, tokens = await goal(client, width, config == "machine check")
                            row.cpu.append(cpu_seconds([proc]) - cpu0)
                            row.spans.append(span)
                            row.calls = len(fake.message_requests) - before
                            if rep == 0:
                                row.tokens = tokens
                            same_tokens = Tokens()
                            row.same.append(await react_same_tasks(model, width, same_tokens))
                            row.same_tokens = same_tokens
                            row.lean.append(await react_lean(model, width))
                        rows.append(row)
            finally:
                stop([proc])
                await model.aclose()
        under = await floor(bench)
    return report(where, delay, reps, concurrency, poll_delay, rows, under)


async def goal(client: Client, width: int, checked: bool) -> tuple[float, Tokens]:
    """Submit one goal and wait for it: (makespan, billed tokens from its ledger)."""
    raw: dict[str, object] = {"text": goal_text(width, 1, STEPS, checked)}
    if checked and width == 1:
        raw["check"] = TASK_CHECK  # the goal is its one task: its definition of done is the task's
    t0 = time.perf_counter()
    gid = await client.submit(raw)
    record = await client.wait(gid, timeout=120)
    span = time.perf_counter() - t0
    if record.state.value != "succeeded":
        raise RuntimeError(f"goal {gid} ended {record.state.value}: {record.reason}")
    books = await client.ledger.snapshot(gid)
    tokens = Tokens(
        input=books.spent_input + books.spent_cache_read + books.spent_cache_write, output=books.spent_output
    )
    return span, tokens


def report(
    where: str,
    delay: float,
    reps: int,
    concurrency: int,
    poll_delay: float,
    rows: list[Row],
    under: Floor | None = None,
) -> str:
    lines = [
        where,
        f"model delay {delay * 1000:.0f} ms per call; one `taskloom worker all` process, executor concurrency "
        f"{concurrency}, poll delay {poll_delay:g} s; median of {reps} runs per row; tokens: billed input + "
        "output per goal",
        "",
        "| width | review | taskloom model calls | critical path (calls) | lower bound s | makespan s "
        "| makespan / bound | single ReAct loop, same tasks s (calls) | makespan / single loop | speed-up "
        "| lean ReAct s (calls) "
        "| speed-up vs lean | taskloom tokens | single loop tokens | tokens taskloom / single |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        calls = critical_calls(row.width, row.config == "machine check")
        bound = calls * delay
        span = statistics.median(row.spans)
        s_same = statistics.median(t for t, _ in row.same)
        s_lean = statistics.median(t for t, _ in row.lean)
        lines.append(
            f"| {row.width} | {row.config} | {row.calls} | {calls} | {bound:.2f} | {span:.2f} | {span / bound:.2f} | "
            f"{s_same:.2f} ({row.same[0][1]}) | {span / s_same:.2f} | {s_same / span:.2f}x | "
            f"{s_lean:.2f} ({row.lean[0][1]}) | {s_lean / span:.2f}x | {row.tokens} | {row.same_tokens} | "
            f"{row.tokens.total / row.same_tokens.total:.2f} |"
        )
    return "\n".join([*lines, "", *targets(rows, delay), *([] if under is None else ["", *cpu_table(rows, under)])])


def cpu_table(rows: list[Row], under: Floor) -> list[str]:
    """The worker's CPU per goal (from /proc, during the goal only), beside the floor of its model
    calls (`bench.floor`: the SDK's CPU per call, measured in this run) and what is left, taskloom's
    own CPU: on a 2-core machine it competes with the fake API and Redis for the makespan."""
    out = [
        f"Floor (`bench.floor`, same run): the Anthropic SDK {under.sdk_cpu_ms_per_call:.2f} ms of CPU per model call.",
        "",
        "| width | review | worker CPU ms per goal | floor: SDK CPU of its model calls ms "
        "| taskloom's own CPU ms per goal | own CPU / makespan |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        cpu = statistics.median(row.cpu) * 1000
        sdk = row.calls * under.sdk_cpu_ms_per_call
        own = cpu - sdk
        out.append(
            f"| {row.width} | {row.config} | {cpu:.0f} | {sdk:.0f} | {own:.0f} | "
            f"{own / 1000 / statistics.median(row.spans):.2f} |"
        )
    return out


# Issue 13's targets: width 1 within 1.5x the single loop; width 8 at least 3.7x faster, within 1.15x
# of its critical-path bound, and spending at most the single loop's tokens.
Check = Callable[[float, float, float, float], bool]  # (makespan, single loop, bound, token ratio) -> met
TARGETS: tuple[tuple[str, int, Check], ...] = (
    ("width 1: makespan <= 1.5x the single loop", 1, lambda span, same, bound, ratio: span / same <= 1.5),
    ("width 8: speed-up >= 3.7x over the single loop", 8, lambda span, same, bound, ratio: same / span >= 3.7),
    ("width 8: makespan <= 1.15x its bound", 8, lambda span, same, bound, ratio: span / bound <= 1.15),
    ("width 8: tokens <= the single loop's", 8, lambda span, same, bound, ratio: ratio <= 1.0),
)


def targets(rows: list[Row], delay: float) -> list[str]:
    """Each target per review configuration, met or not, from this run's rows (none without the width)."""
    out = ["| target | " + " | ".join(CONFIGS) + " |", "| --- |" + " --- |" * len(CONFIGS)]
    for name, width, met in TARGETS:
        cells = []
        for config in CONFIGS:
            row = next((r for r in rows if r.width == width and r.config == config), None)
            if row is None:
                cells.append("not run")
                continue
            span = statistics.median(row.spans)
            same = statistics.median(t for t, _ in row.same)
            bound = critical_calls(width, config == "machine check") * delay
            ratio = row.tokens.total / row.same_tokens.total
            cells.append("met" if met(span, same, bound, ratio) else "**not met**")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


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
