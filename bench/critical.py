"""Where a wide goal's makespan goes beyond its critical-path bound, phase by phase.

    python -m bench.critical [--redis-url redis://127.0.0.1:6379/0] [--width 8] [--reps 10] [--delay 0.2]
                             [--poll-delay 0.05]

The setting of `bench.speedup`'s widest row with model review: one `taskloom worker all` process
(executor concurrency `--width`), goals of `--width` independent tasks, each a 2-step tool loop,
against the fake Messages API answering every call after `--delay` s. The bound is 4 model delays
(plan, the two steps of a task, the final answer with its verdict); everything above it is the
orchestrator's, the SDK's and the fake server's. From the worker's JSON log (its `goal_id`-tagged
events) and the client's clock, each goal's time above the bound is split into:

- plan: submit -> `plan.stored`, less one delay (the job's pick-up, the planner's call, the plan's write);
- fan-out: `plan.stored` -> the last task's `execute.start` (dispatch, pick-up and start of every task:
  on one process, the tasks' start-up work runs one after another);
- tasks: the last `execute.start` -> the last `execute.result`, less two delays (the calls' own
  work, the tool, the step writes; and the other tasks' work on the same event loop);
- hand-off: the last `execute.result` -> the final answer's job starting (`review_goal`'s
  `job.start`: the result's write, the review job, the speculation's enqueue and pick-up);
- final: that `job.start` -> the client seeing the goal succeed, less one delay.

The phases add up to the makespan less its bound. The report gives the median of each over
`--reps` goals (after two warm-up goals). Keys live under a unique prefix and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from bench._harness import (
    DEFAULT_REDIS,
    Responder,
    bench_redis,
    goal_text,
    machine,
    profile_from_now,
    profile_until_now,
    spawn_worker,
    stop,
    wait_for_keys,
    worker_all_env,
)
from bench.speedup import STEPS, critical_calls
from bus.client import Client
from llm.testing import FakeAnthropicServer

PHASES = ("plan", "fan-out", "tasks", "hand-off", "final")


@dataclass(frozen=True)
class Event:
    at: float  # epoch seconds
    name: str
    function: str | None = None


def goal_events(lines: Iterable[str]) -> dict[str, list[Event]]:
    """goal_id -> its events, in log order, from a worker's JSON log lines (others skipped)."""
    out: dict[str, list[Event]] = {}
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
            at = datetime.fromisoformat(d["timestamp"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        gid = d.get("goal_id")
        if isinstance(gid, str):
            out.setdefault(gid, []).append(Event(at, str(d.get("event")), d.get("function")))
    return out


def phases(events: Sequence[Event], submitted: float, ended: float, delay: float) -> dict[str, float]:
    """One goal's seconds above its bound, by phase (module doc). Raises ValueError when the log lacks
    an event a phase needs (a goal that did not take the planned path)."""

    def times(name: str, function: str | None = None) -> list[float]:
        found = [e.at for e in events if e.name == name and (function is None or e.function == function)]
        if not found:
            raise ValueError(f"no {name} event" + (f" of {function}" if function else ""))
        return found

    stored = min(times("plan.stored"))
    started, result = max(times("execute.start")), max(times("execute.result"))
    final = max(times("job.start", "review_goal"))
    return {
        "plan": stored - submitted - delay,
        "fan-out": started - stored,
        "tasks": result - started - (STEPS + 1) * delay,
        "hand-off": final - result,
        "final": ended - final - delay,
    }


def table(rows: Sequence[Mapping[str, float]], spans: Sequence[float], bound: float) -> list[str]:
    """The median of each phase (ms) and of the makespan's excess over the bound."""
    med = {p: statistics.median(r[p] for r in rows) * 1000 for p in PHASES}
    over = statistics.median(s - bound for s in spans) * 1000
    return [
        "| " + " | ".join(PHASES) + " | sum of the medians | makespan - bound (median) |",
        "| " + " | ".join("---:" for _ in PHASES) + " | ---: | ---: |",
        "| " + " | ".join(f"{med[p]:.1f}" for p in PHASES) + f" | {sum(med.values()):.1f} | {over:.1f} |",
    ]


async def run(url: str, width: int, reps: int, delay: float, poll_delay: float = 0.05) -> str:
    async with bench_redis(url, "critical") as bench:
        where = await machine(bench.redis, bench.where)
        with FakeAnthropicServer() as fake:
            fake.respond_with(Responder(delay=delay))
            env = worker_all_env(bench, poll_delay=poll_delay, base_url=fake.base_url, concurrency=width)
            log = bench.home / "worker.log"
            proc = spawn_worker("all", env, log)
            marks: list[tuple[str, float, float]] = []
            try:
                await wait_for_keys(
                    bench.redis, [bench.keys.health_check(r) for r in ("planner", "executor", "critic")], [proc]
                )
                client = Client(bench.redis, bench.keys, default_budget_tokens=10_000_000)
                for rep in range(reps + 2):  # two warm-up goals: imports, connections, scripts
                    submitted = time.time()
                    gid = await client.submit({"text": goal_text(width, 1, STEPS)})
                    record = await client.wait(gid, timeout=120)
                    ended = time.time()
                    if record.state.value != "succeeded":
                        raise RuntimeError(f"goal {gid} ended {record.state.value}: {record.reason}")
                    if rep >= 2:
                        marks.append((gid, submitted, ended))
                    if rep == 1:
                        profile_from_now([proc])  # under BENCH_PROFILE: the measured goals only
                profile_until_now([proc])
                await asyncio.sleep(0.3)  # the last lines reach the log
            finally:
                stop([proc])
            text = await asyncio.to_thread(log.read_text, errors="replace")
    events = goal_events(text.splitlines())
    bound = critical_calls(width) * delay
    rows = [phases(events.get(gid, []), s, e, delay) for gid, s, e in marks]
    spans = [e - s for _, s, e in marks]
    return "\n".join(
        [
            where,
            f"width {width}, model review, one `taskloom worker all` process, poll delay {poll_delay:g} s, "
            f"model delay {delay * 1000:.0f} ms, "
            f"bound {bound:.2f} s, {reps} goals; medians in ms",
            "",
            *table(rows, spans, bound),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--poll-delay", type=float, default=0.05, help="as bench.speedup's (wake-ups are on)")
    args = parser.parse_args()
    if args.width < 2 or args.reps < 1 or args.delay <= 0:
        parser.error("need --width >= 2 (a one-task goal takes another path), --reps >= 1, --delay > 0")
    started = datetime.now(UTC)
    report = asyncio.run(run(args.redis_url, args.width, args.reps, args.delay, args.poll_delay))
    print(f"{started:%Y-%m-%d %H:%M} UTC\n{report}")


if __name__ == "__main__":
    main()
