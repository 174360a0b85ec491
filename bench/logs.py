"""The CPU of one log line, as a worker writes it (`taskloom.logs.configure_logging`, JSON).

    python -m bench.logs [--lines 20000]

A worker writes a few lines per job (`job.start`, `job.end`, what the handler did) with the job's
context bound (role, job id and try, goal, task, attempt). This prints the CPU per line of such a
line written to /dev/null, of a line below the level (dropped), and of a stdlib line (arq's own,
rendered by the same processors), best of 5 rounds. Not a target of its own: what it costs is part
of every job's CPU (`bench.throughput`).
"""

from __future__ import annotations

import argparse
import logging
import time
from datetime import UTC, datetime

import structlog

from bench._harness import cpu_probe_ms
from taskloom.logs import configure_logging

CONTEXT = {"role": "executor", "job_id": "job:execute:0f3c2a:c0-t0:1", "job_try": 1, "goal_id": "0f3c2a9d1b7e4c55",
           "task_id": "c0-t0", "attempt": 1}


def per_line_us(write: object, lines: int) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(lines):
            write()  # type: ignore[operator]
        best = min(best, (time.process_time() - t) / lines * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=20000)
    args = parser.parse_args()
    with open("/dev/null", "w") as sink:
        configure_logging("INFO", json=True, stream=sink)
        log = structlog.get_logger("taskloom.worker")
        arq = logging.getLogger("arq.worker")
        with structlog.contextvars.bound_contextvars(**CONTEXT):
            ours = per_line_us(lambda: log.info("job.start", function="execute"), args.lines)
            below = per_line_us(lambda: log.debug("job.start", function="execute"), args.lines)
            stdlib = per_line_us(lambda: arq.info("%6.2fs → %s(%s)", 0.01, "job:execute:0f3c2a", "{...}"), args.lines)
    rows = [
        ("a line of ours (`job.start`)", ours),
        ("a line below the level (debug)", below),
        ("a stdlib line (arq's job start)", stdlib),
    ]
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}; speed now: CPU probe {cpu_probe_ms():.1f} ms (bench._harness.cpu_probe_ms)\n")
    print("| line | CPU µs per line (best of 5) |\n| --- | ---: |")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
