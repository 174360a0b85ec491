"""The benchmarks' toolkit, loaded by worker processes with `TASKLOOM_TOOLS=bench.toolkit:kit`.

`fetch` returns a deterministic observation of `BENCH_OBSERVATION_CHARS` characters (default 200)
at once, so that a task's time is the model's time plus taskloom's own.
"""

from __future__ import annotations

import os

from executor.toolkit import Toolkit

kit = Toolkit("bench")


def observation(item: str, chars: int) -> str:
    head = f"record {item}: "
    body = "lorem ipsum dolor sit amet " * (chars // 27 + 1)
    return (head + body)[:chars]


@kit.tool(read_only=True)
def fetch(item: str) -> str:
    """Fetch one record by its id."""
    return observation(item, int(os.environ.get("BENCH_OBSERVATION_CHARS", "200")))
