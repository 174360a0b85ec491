"""What a Redis command costs the client on the shared connection (`bus.mux`) and through redis-py's
pool, with one caller and with many at once.

    python -m bench.coalesce [--redis-url redis://127.0.0.1:6379/0] [--commands 4000] [--clients 1,8,100]

`--clients` coroutines each send commands one after the other (each awaits its reply before the
next, as a job does), `--commands` in all, through the client a worker holds
(`bus.connection.connect`), twice, in the same process and loop:

- **pool**: `TASKLOOM_REDIS_SHARED_CONNECTION=false`: redis-py's pool, hiredis, the `_Lean` packer.
  Each command in flight holds a connection of its own and makes its own `send` and `recv`.
- **shared**: the default: one connection for the process's short commands, each reply matched to
  its command in order; while Redis is busy, several replies come back in one read.

The command is an `EVALSHA` of a script that returns its 14 arguments' count (the size of a ledger
reserve; it reads and writes nothing). Reported per client: CPU microseconds of this process per
command (`time.process_time`, against the real Redis at `--redis-url`) and commands per second,
best of `--rounds` alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench._harness import cpu_probe_ms
from bus import mux
from bus.connection import connect
from taskloom import eventloop

SCRIPT = "return #ARGV"
ARGS = 14


async def _measure(send: Any, clients: int, commands: int) -> tuple[float, float]:
    per = max(1, commands // clients)

    async def one() -> None:
        for _ in range(per):
            await send()

    await asyncio.gather(*(one() for _ in range(min(clients, 50))))  # warm: connections, caches
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(clients)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    n = per * clients
    return cpu / n * 1e6, n / wall


async def run(url: str, commands: int, levels: list[int], rounds: int) -> str:
    args = [str(i) for i in range(ARGS)]
    rows = []
    async with (
        connect(url, Path("/nonexistent"), share=False) as pool,
        connect(url, Path("/nonexistent"), share=True) as shared,
    ):
        sha = await pool.script_load(SCRIPT)
        clients_by_name = {"pool": pool, "shared": shared}
        for clients in levels:
            best: dict[str, tuple[float, float]] = {}
            for _ in range(rounds):  # alternating, best CPU of the rounds per client
                for name, client in clients_by_name.items():

                    async def send(client: Any = client) -> Any:
                        return await client.evalsha(sha, 1, "bench-coalesce", *args)

                    got = await _measure(send, clients, commands)
                    if name not in best or got[0] < best[name][0]:
                        best[name] = got
            rows.append((clients, best["pool"], best["shared"]))
    lines = [
        f"Redis at {url}; {commands} EVALSHA ({ARGS} arguments) per client and round, best of {rounds} "
        f"alternating rounds; on {eventloop.choice()}; speed now: CPU probe {cpu_probe_ms():.1f} ms",
        "",
        "| concurrent callers | pool: CPU µs per command | pool: commands/s | shared: CPU µs per command "
        "| shared: commands/s | CPU shared / pool |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for clients, (pcpu, prate), (scpu, srate) in rows:
        lines.append(f"| {clients} | {pcpu:.1f} | {prate:,.0f} | {scpu:.1f} | {srate:,.0f} | {scpu / pcpu:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--commands", type=int, default=4000)
    parser.add_argument("--clients", default="1,8,100")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not mux.HIREDIS:
        parser.error("needs hiredis (installed with taskloom): pip install hiredis")
    levels = [int(c) for c in args.clients.split(",")]
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = eventloop.run(run(args.redis_url, args.commands, levels, args.rounds))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
