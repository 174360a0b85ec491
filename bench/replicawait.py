"""What the replica guard costs (`TASKLOOM_REDIS_WAIT_REPLICAS`, bus.durability): guarded writes with
and without `WAIT 1`, against a primary and a replica of our own on loopback.

    python -m bench.replicawait [--ops 2000] [--clients 1,10] [--redis-server /usr/bin/redis-server]

Starts a primary (AOF `everysec`) and a replica in a temporary directory on free ports, and stops
them afterwards. For each number of concurrent clients (coroutines sharing one pool) it measures,
with the guard off and then on, in alternating rounds so that both see the same background load:

* a ledger pair: `reserve` + `settle` (both guarded: EVALSHA and WAIT in one round trip each);
* a side effect: `begin` + `finish` (both guarded).

A job pays two guarded writes per model call (reserve, settle) and two per side-effecting tool call, so
the per-job cost is read from these two rows. Commands per guarded write: off, 1 (EVALSHA or
HSET); on, 2 (the same and WAIT), still one round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import redis as redis_sync

from bus import durability
from bus.connection import connect
from bus.effects import EffectRecord, SideEffects
from bus.keys import Keys
from bus.ledger import Ledger
from bus.retention import delete_all
from llm.types import Usage

USAGE = Usage(input_tokens=400, output_tokens=700)
ROUNDS = 4
GUARD = durability.ReplicaWait(replicas=1, timeout=0.5)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def primary_and_replica(binary: str) -> Iterator[str]:
    """A primary and its replica on loopback; yields the primary's URL once the replica is in sync."""
    root = Path(tempfile.mkdtemp(prefix="bench-replicawait-"))
    ports = [_free_port(), _free_port()]
    procs = []
    try:
        for i, port in enumerate(ports):
            (root / str(port)).mkdir()
            conf = [f"port {port}", "bind 127.0.0.1", f"dir {root / str(port)}", "appendonly yes", 'save ""']
            conf += ["repl-diskless-sync yes", "repl-diskless-sync-delay 0"]
            if i:
                conf.append(f"replicaof 127.0.0.1 {ports[0]}")
            (root / f"{port}.conf").write_text("\n".join(conf) + "\n")
            procs.append(
                subprocess.Popen(
                    [binary, str(root / f"{port}.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        deadline = time.monotonic() + 20
        while True:
            try:
                with redis_sync.Redis(port=ports[1]) as replica:
                    if replica.info("replication").get("master_link_status") == "up":
                        break
            except redis_sync.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not sync within 20 s")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


async def _measure(clients: int, ops: int, op: Callable[[int], Awaitable[object]]) -> tuple[list[float], float]:
    latencies: list[float] = []
    per_client = max(1, ops // clients)

    async def one(c: int) -> None:
        for i in range(per_client):
            t = time.perf_counter()
            await op(c * per_client + i)
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(one(c) for c in range(clients)))
    return latencies, time.perf_counter() - start


def _row(name: str, clients: int, lat: list[float], wall: float) -> str:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return f"| {name} | {clients} | {len(lat) / wall:,.0f} | {q[49] * 1000:.3f} | {q[98] * 1000:.3f} |"


async def run(url: str, ops: int, client_counts: list[int]) -> list[str]:
    keys = Keys(prefix=f"bench:{uuid.uuid4().hex[:8]}:")
    rows = ["| operation | clients | per second | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    async with connect(url, Path(tempfile.gettempdir())) as redis:
        ledger = Ledger(redis, keys)
        effects = SideEffects(redis, keys)
        await ledger.open("g", 10**12)

        async def pair(_: int) -> None:
            r = await ledger.reserve("g", 400, 1000)
            await ledger.settle(r, USAGE)

        async def effect(i: int) -> None:
            record = EffectRecord(key=f"charge:{i}", tool="charge", attempt=1, call_id=str(i))
            await effects.begin("g", f"t{i % 50}", record)
            await effects.finish("g", f"t{i % 50}", record.model_copy(update={"state": "ok"}))

        try:
            results: dict[tuple[str, int, str], tuple[list[float], float]] = {}
            for clients in client_counts:
                for _ in range(ROUNDS):
                    for guard in ("off", "WAIT 1"):
                        durability.require(redis, GUARD if guard != "off" else durability.OFF)
                        for name, op in (("reserve + settle", pair), ("side effect begin + finish", effect)):
                            lat, wall = await _measure(clients, ops // ROUNDS, op)
                            acc = results.setdefault((name, clients, guard), ([], 0.0))
                            results[(name, clients, guard)] = (acc[0] + lat, acc[1] + wall)
            for (name, clients, guard), (lat, wall) in results.items():
                rows.append(_row(f"{name}, guard {guard}", clients, lat, wall))
        finally:
            durability.require(redis, durability.OFF)
            await delete_all(redis, keys)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--clients", default="1,10")
    default_binary = "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else "redis-server"
    parser.add_argument("--redis-server", default=default_binary)
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    with primary_and_replica(args.redis_server) as url:
        with redis_sync.Redis.from_url(url) as probe:
            version = dict(probe.info("server"))["redis_version"]
        rows = asyncio.run(run(url, args.ops, counts))
    when = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    print(f"{when}, Python {platform.python_version()}, Redis {version}, {os.cpu_count()} CPUs")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
