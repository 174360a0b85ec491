"""How much a metered model call pays for its bookkeeping: reserve + settle pairs against Redis.

    python -m bench.ledger [--redis-url redis://127.0.0.1:6379/0] [--ops 3000] [--clients 1,10,100]

For each number of concurrent clients (coroutines sharing one connection pool), measures reserve +
settle pairs per second and their p50/p99 latency, then the same pairs on the tenant-pool path (a
goal of a tenant with a monthly pool limited in tokens and dollars, the goal with a dollar budget
too: the reserve script reads the tenant's settings and draws from the goal and the period pool in
both units), then a plain PING under the same concurrency, in the same run. The target is a pair
costing no more than 2.2 PINGs at p50 with one client, and the tenant-pool path at most 10% more
(issue 32; the report ends with both, met or not): a reserve is one EVALSHA and a settle another.
The client is the pool a worker uses (`bus.connection.connect`). Everything is written under a unique
key prefix and deleted afterwards.

Also measured, as a prototype that is not in the product: the settle of each call folded into the
goal's next reserve (`FOLDED`: the product's close and reserve scripts run one after the other in
one script, so a call costs one round trip instead of two). It shows what that design would bring
the pair to, before anyone changes when spending is booked for it. When the URL cannot be reached,
an embedded redis-server is started instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from redis.asyncio import Redis

from bench._harness import cpu_probe_ms
from bus.connection import connect
from bus.keys import Keys
from bus.ledger import Ledger
from bus.ledger_records import Reservation, reservation_from_reply
from bus.retention import delete_all
from bus.scripts import lua
from bus.tenants import Tenants
from llm.types import Usage

GOAL = "bench"
TENANT_GOAL = "bench-tenant"
USAGE = Usage(input_tokens=400, output_tokens=700, cache_read_tokens=50)


MODEL = "claude-sonnet-4-6"

# The prototype: the close script (its KEYS: open hash, expiry set) and then the reserve script (its
# KEYS: goal books, open hash, expiry set), each run as a function with its own KEYS and ARGV, in
# one script. ARGV: the number n of the close's arguments (0: nothing to close), those n, then the
# reserve's. Replies as the reserve does.
FOLDED = (
    lua("ledger_lib")
    + "local function run_close(KEYS, ARGV)\n"
    + lua("ledger_close")
    + "\nend\nlocal function run_reserve(KEYS, ARGV)\n"
    + lua("ledger_reserve")
    + """
end
local n = tonumber(ARGV[1])
if n > 0 then
  local args = {}
  for i = 2, n + 1 do args[#args + 1] = ARGV[i] end
  run_close({KEYS[2], KEYS[3]}, args)
end
local args = {}
for i = n + 2, #ARGV do args[#args + 1] = ARGV[i] end
return run_reserve(KEYS, args)
"""
)


class Folded:
    """Per goal, the reservation whose settle rides on the goal's next reserve (the prototype)."""

    def __init__(self, redis: Redis, ledger: Ledger) -> None:
        self.ledger = ledger
        self.script = redis.register_script(FOLDED)
        self.held: dict[str, Reservation] = {}

    async def call(self, goal: str) -> None:
        """One call's bookkeeping: settle the goal's previous call (if any) and reserve for this one."""
        led = self.ledger
        rid, keys, reserve = led.reserve_call(goal, 500, 1000, MODEL)
        previous = self.held.get(goal)
        close: list[str | int] = []
        if previous is not None:
            close = led.close_args(previous, "settle", False, None, *led.settled_usage(USAGE, MODEL))
        out = await self.script(keys=keys, args=[len(close), *close, *reserve])
        self.held[goal] = reservation_from_reply(out, rid, goal, 500, MODEL)

    async def settle_all(self) -> None:
        for res in self.held.values():
            await self.ledger.settle(res, USAGE, model=MODEL)
        self.held.clear()


ROUNDS = 5  # pairs and PINGs alternate in rounds, so both see the same background load


@dataclass(frozen=True)
class Stats:
    per_second: float
    p50_ms: float
    p99_ms: float


def stats(latencies: list[float], wall: float) -> Stats:
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return Stats(len(latencies) / wall, q[49] * 1000, q[98] * 1000)


async def measure(clients: int, ops: int, op: Callable[[], Awaitable[object]]) -> tuple[list[float], float]:
    """Run about `ops` calls of `op` from `clients` concurrent coroutines: (latencies, wall time)."""
    latencies: list[float] = []
    per_client = max(1, ops // clients)

    async def client() -> None:
        for _ in range(per_client):
            t0 = time.perf_counter()
            await op()
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies, time.perf_counter() - start


async def compare(clients: int, ops: int, named: dict[str, Callable[[], Awaitable[object]]]) -> dict[str, Stats]:
    results: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name in named}
    for _ in range(ROUNDS):
        for name, op in named.items():
            lat, wall = await measure(clients, ops // ROUNDS, op)
            results[name] = (results[name][0] + lat, results[name][1] + wall)
    return {name: stats(*r) for name, r in results.items()}


@contextlib.asynccontextmanager
async def redis_at(url: str) -> AsyncIterator[tuple[Redis, str]]:
    """The server at `url`, or an embedded one if it cannot be reached."""
    probe = Redis.from_url(url, socket_connect_timeout=1)
    try:
        await probe.ping()
        reachable = True
    except (OSError, ConnectionError, Exception):  # any failure to reach it: fall back
        reachable = False
    finally:
        await probe.aclose()
    # The pool a worker uses (`bus.connection.connect`: its connection class, packing and checks),
    # so that the pairs and the PINGs cost what they cost in a worker.
    with tempfile.TemporaryDirectory(prefix="taskloom-bench-") as home:
        async with connect(url if reachable else None, Path(home)) as redis:
            yield redis, url if reachable else "embedded redis-server (unix socket)"


async def run(url: str, ops: int, levels: list[int]) -> str:
    async with redis_at(url) as (redis, where):
        keys = Keys(prefix=f"bench:{uuid.uuid4().hex[:12]}:")
        ledger = Ledger(redis, keys)
        await ledger.open(GOAL, 10**15)
        await Tenants(redis, keys).set("bench", period="month", budget_tokens=10**15, budget_usd=10**9)
        await ledger.open(TENANT_GOAL, 10**15, budget_usd=10**5, tenant="bench")

        async def pair() -> None:
            res = await ledger.reserve(GOAL, 500, 1000, model=MODEL)
            await ledger.settle(res, USAGE, model=MODEL)

        async def tenant_pair() -> None:
            res = await ledger.reserve(TENANT_GOAL, 500, 1000, model=MODEL)
            await ledger.settle(res, USAGE, model=MODEL)

        folded = Folded(redis, ledger)

        async def folded_call() -> None:
            await folded.call(GOAL)

        async def folded_tenant_call() -> None:
            await folded.call(TENANT_GOAL)

        async def ping() -> None:
            await redis.ping()

        ops_by_name: dict[str, Callable[[], Awaitable[object]]] = {"pair": pair, "tenant": tenant_pair, "ping": ping}
        # One client only: each goal's chain of calls is sequential, as one agent's calls are.
        folded_ops: dict[str, Callable[[], Awaitable[object]]] = {
            "folded": folded_call,
            "folded_tenant": folded_tenant_call,
            "ping": ping,
        }
        try:
            await compare(max(levels), 1000, ops_by_name)  # warm up: scripts loaded, connections open
            rows = []
            for clients in levels:
                r = await compare(clients, ops, ops_by_name)
                rows.append((clients, r["pair"], r["tenant"], r["ping"]))
            await compare(1, 500, folded_ops)  # warm up
            f = await compare(1, ops, folded_ops)
            proto = (f["folded"], f["folded_tenant"], f["ping"])
            await folded.settle_all()
            for goal in (GOAL, TENANT_GOAL):
                snap = await ledger.snapshot(goal)
                assert snap.reserved == 0 and snap.open == 0, snap
        finally:
            await delete_all(redis, keys)
        info = await redis.info("server")
    return report(rows, where, str(info.get("redis_version", "?")), ops, proto)


def report(
    rows: list[tuple[int, Stats, Stats, Stats]],
    where: str,
    version: str,
    ops: int,
    proto: tuple[Stats, Stats, Stats] | None = None,
) -> str:
    lines = [
        f"Redis {version} at {where}; {ops} operations per level and path; python {platform.python_version()}; "
        f"speed now: CPU probe {cpu_probe_ms():.1f} ms (bench._harness.cpu_probe_ms)",
        "",
        "| clients | path | pairs/s | pair p50 ms | pair p99 ms | PING/s | PING p50 ms | PING p99 ms | p50 ratio "
        "| p99 ratio |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for clients, p, t, r in rows:
        for path, x in (("goal only", p), ("goal + tenant pool, tokens + USD", t)):
            lines.append(
                f"| {clients} | {path} | {x.per_second:,.0f} | {x.p50_ms:.3f} | {x.p99_ms:.3f} | "
                f"{r.per_second:,.0f} | {r.p50_ms:.3f} | {r.p99_ms:.3f} | {x.p50_ms / r.p50_ms:.2f} | "
                f"{x.p99_ms / r.p99_ms:.2f} |"
            )
    lines += ["", "| target (issue 32) | measured | |", "| --- | ---: | --- |"]
    for clients, p, t, r in rows:
        if clients != 1:
            continue
        ratio, extra = p.p50_ms / r.p50_ms, t.p50_ms / p.p50_ms - 1
        lines.append(
            f"| pair p50 <= {PAIR_TARGET:g}x PING p50, 1 client | {ratio:.2f}x | "
            f"{'met' if ratio <= PAIR_TARGET else f'**not met** ({ratio / PAIR_TARGET:.2f}x the target)'} |"
        )
        lines.append(
            f"| tenant pool + USD pair p50 <= goal-only + {TENANT_EXTRA:.0%}, 1 client | {extra:+.0%} | "
            f"{'met' if extra <= TENANT_EXTRA else '**not met**'} |"
        )
    if proto is not None:
        f, ft, r = proto
        lines += [
            "",
            "Prototype, not in the product: each call's settle folded into the goal's next reserve (one "
            "script, one round trip per call), 1 client:",
            "",
            "| path | per call p50 ms | PING p50 ms | ratio | tenant pool + USD / goal only |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| goal only | {f.p50_ms:.3f} | {r.p50_ms:.3f} | {f.p50_ms / r.p50_ms:.2f}x | |",
            f"| goal + tenant pool, tokens + USD | {ft.p50_ms:.3f} | {r.p50_ms:.3f} | {ft.p50_ms / r.p50_ms:.2f}x "
            f"| {ft.p50_ms / f.p50_ms - 1:+.0%} |",
        ]
    return "\n".join(lines)


PAIR_TARGET = 2.2  # issue 32: a reserve + settle pair at most this many PINGs (p50, 1 client)
TENANT_EXTRA = 0.10  # and the tenant-pool path at most this much dearer than the goal-only one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--ops", type=int, default=3000, help="pairs (and PINGs) per concurrency level")
    parser.add_argument("--clients", default="1,10,100", help="comma-separated concurrency levels")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    table = asyncio.run(run(args.redis_url, args.ops, levels))
    print(f"{started:%Y-%m-%d %H:%M} UTC, {time.perf_counter() - t0:.1f} s\n{table}")


if __name__ == "__main__":
    main()
