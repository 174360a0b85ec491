"""What a Redis command costs the client when concurrent jobs share one write: the ceiling of a
multiplexing connection, measured before anyone builds one.

    python -m bench.coalesce [--redis-url redis://127.0.0.1:6379/0] [--commands 4000] [--clients 1,8,100]

`--clients` coroutines each send commands one after the other (each awaits its reply before the
next, as a job does), `--commands` in all, through two clients, in the same process and loop:

- **pool**: the connection pool a worker uses (`bus.connection.connect`: redis-py, hiredis, the
  `_Lean` packer). Each command in flight holds a connection of its own and makes its own `send`.
- **shared**: a prototype, here only: one connection for all; a command's bytes are appended to a
  buffer that is written once per event-loop turn (`call_soon`), and replies are matched to their
  commands first in, first out (hiredis's reader). Commands sent in the same turn share a `send`
  and the `recv` of their replies.

The command is an `EVALSHA` of a script that returns its 14 arguments' count (the size of a ledger
reserve; it reads and writes nothing). Reported per client: CPU microseconds of this process per
command (`time.process_time`, against the real Redis at `--redis-url`), commands per second, and the
mean number of commands per write for the shared client. Needs hiredis (`pip install
'taskloom[fast]'`), whose packer and reader both clients use. The prototype has none of
what a product client needs (reconnects, timeouts, cancellation mid-reply, blocking commands and
`WATCH` kept apart, the replica `WAIT`): it measures the most such a client could save.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

try:
    import hiredis
except ImportError:  # the `fast` extra; main() says so
    hiredis = None

from bench._harness import cpu_probe_ms
from bus.connection import connect
from taskloom import eventloop

SCRIPT = "return #ARGV"
ARGS = 14


class Shared:
    """One connection; writes coalesced per loop turn; replies matched in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.parser = hiredis.Reader()
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.buffer: list[bytes] = []
        self.writes = 0
        self.commands = 0
        self._reading = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, host: str, port: int) -> Shared:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    def execute(self, *args: Any) -> asyncio.Future[Any]:
        if not self.buffer:
            asyncio.get_running_loop().call_soon(self._flush)
        self.buffer.append(hiredis.pack_command(args))
        future = asyncio.get_running_loop().create_future()
        self.pending.append(future)
        return future

    def _flush(self) -> None:
        self.writes += 1
        self.commands += len(self.buffer)
        self.writer.write(b"".join(self.buffer))
        self.buffer.clear()

    async def _read(self) -> None:
        while True:
            data = await self.reader.read(65536)
            if not data:
                return
            self.parser.feed(data)
            while (reply := self.parser.gets()) is not False:
                future = self.pending.popleft()
                if not future.cancelled():
                    future.set_result(reply)

    async def close(self) -> None:
        self._reading.cancel()
        self.writer.close()
        await self.writer.wait_closed()


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
    from redis.asyncio.connection import parse_url

    parts = parse_url(url)
    host, port = parts.get("host", "127.0.0.1"), int(parts.get("port", 6379))
    key = f"bench-coalesce:{uuid.uuid4().hex[:8]}"
    args = [str(i) for i in range(ARGS)]
    rows = []
    async with connect(url, Path("/nonexistent")) as pool:
        sha = await pool.script_load(SCRIPT)
        shared = await Shared.open(host, port)
        try:
            for clients in levels:
                best: dict[str, tuple[float, float]] = {}
                writes0 = commands0 = 0
                for _ in range(rounds):  # alternating, best CPU of the rounds per client
                    for name in ("pool", "shared"):
                        if name == "pool":

                            async def send_pool() -> Any:
                                return await pool.evalsha(sha, 1, key, *args)

                            got = await _measure(send_pool, clients, commands)
                        else:
                            writes0, commands0 = shared.writes, shared.commands

                            def send_shared() -> asyncio.Future[Any]:
                                return shared.execute("EVALSHA", sha, 1, key, *args)

                            got = await _measure(send_shared, clients, commands)
                        if name not in best or got[0] < best[name][0]:
                            best[name] = got
                batch = (shared.commands - commands0) / max(1, shared.writes - writes0)
                rows.append((clients, best["pool"], best["shared"], batch))
        finally:
            await shared.close()
    lines = [
        f"Redis at {url}; {commands} EVALSHA ({ARGS} arguments) per client and round, best of {rounds} "
        f"alternating rounds; on {eventloop.choice()}; speed now: CPU probe {cpu_probe_ms():.1f} ms",
        "",
        "| concurrent callers | pool: CPU µs per command | pool: commands/s | shared: CPU µs per command "
        "| shared: commands/s | shared: commands per write | CPU shared / pool |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for clients, (pcpu, prate), (scpu, srate), batch in rows:
        lines.append(
            f"| {clients} | {pcpu:.1f} | {prate:,.0f} | {scpu:.1f} | {srate:,.0f} | {batch:.1f} | {scpu / pcpu:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--commands", type=int, default=4000)
    parser.add_argument("--clients", default="1,8,100")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if hiredis is None:
        parser.error("needs hiredis: pip install 'taskloom[fast]'")
    levels = [int(c) for c in args.clients.split(",")]
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = eventloop.run(run(args.redis_url, args.commands, levels, args.rounds))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
