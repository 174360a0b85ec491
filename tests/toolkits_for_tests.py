"""Toolkits used by executor tests, importable by worker subprocesses (TASKLOOM_TOOLS=toolkits_for_tests:kit).

Tools that must be counted across processes append a line to the file named by TL_COUNTER_FILE.
"""

from __future__ import annotations

import asyncio
import os
import time

from executor.toolkit import ToolContext, Toolkit

kit = Toolkit("testkit")
SPANS: list[tuple[str, float, float]] = []  # (tool, start, end) in this process


def _count(line: str) -> None:
    path = os.environ.get("TL_COUNTER_FILE")
    if path:
        with open(path, "a") as fh:
            fh.write(line + "\n")


@kit.tool(read_only=True)
async def slow_a(x: int) -> str:
    """Slow read-only tool A."""
    start = time.monotonic()
    await asyncio.sleep(0.3)
    SPANS.append(("slow_a", start, time.monotonic()))
    return f"a={x}"


@kit.tool(read_only=True)
async def slow_b(x: int) -> str:
    """Slow read-only tool B."""
    start = time.monotonic()
    await asyncio.sleep(0.3)
    SPANS.append(("slow_b", start, time.monotonic()))
    return f"b={x}"


@kit.tool
def boom() -> str:
    """Always raises."""
    raise RuntimeError("kaboom")


@kit.tool(timeout=0.2)
async def hang() -> str:
    """Never returns in time."""
    await asyncio.sleep(30)
    return "late"


@kit.tool
async def sleepy(seconds: float) -> str:
    """Sleeps (uses the gateway's default timeout)."""
    await asyncio.sleep(seconds)
    return "awake"


@kit.tool
def count(name: str) -> str:
    """Counts how often it runs (across processes)."""
    _count(name)
    return f"counted {name}"


@kit.tool
def big(n: int = 0) -> str:
    """Returns a long output."""
    return "x" * 10_000


@kit.tool(side_effects=True)
def charge(amount: int, ctx: ToolContext) -> str:
    """Charges money: side effects, never run twice."""
    _count(f"charge {amount} {ctx.idempotency_key}")
    return f"charged {amount}"


@kit.tool(requires_approval=True)
def wipe(target: str) -> str:
    """Needs a person's approval."""
    _count(f"wipe {target}")
    return f"wiped {target}"


@kit.tool(read_only=True)
async def timed(name: str, seconds: float) -> str:
    """Sleeps, then records `timed <name> <pid> <start> <end>` (monotonic clock) in the counter file."""
    start = time.monotonic()
    await asyncio.sleep(seconds)
    _count(f"timed {name} {os.getpid()} {start:.6f} {time.monotonic():.6f}")
    return f"{name} took {seconds} s"


@kit.tool(side_effects=True, requires_approval=True)
def refund(order: str) -> str:
    """Refunds an order: side effects, and a person approves each call."""
    _count(f"refund {order}")
    return f"refunded {order}"


FLAKY: dict[str, int] = {}  # calls per key in this process


@kit.tool(read_only=True)
async def flaky(key: str, fails: int) -> str:
    """Fails its first `fails` calls per key (a backend briefly unavailable), then answers."""
    FLAKY[key] = FLAKY.get(key, 0) + 1
    if FLAKY[key] <= fails:
        raise RuntimeError("backend unavailable, try again")
    return f"{key}: fine after {FLAKY[key]} calls"
