"""The shared connection (bus.mux) against a real Redis: replies reach the caller that sent the
command, redis-py's reply parsing and errors are kept, what must not share a connection keeps the
pool, and a cancelled caller, a bad argument, a killed connection or a timeout harms nobody else."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio
import redis.exceptions

from bus import mux
from bus.connection import connect

pytestmark = pytest.mark.skipif(not mux.HIREDIS, reason="hiredis not installed: every command keeps the pool")

# A script that spins inside Redis for about ARGV[1] ms (no sleep exists in Lua; TIME is allowed).
SPIN = """
local t = redis.call('TIME')
local stop = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 + tonumber(ARGV[1])
while true do
  t = redis.call('TIME')
  if tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 >= stop then break end
end
return ARGV[2]
"""


def connections(client: redis.asyncio.Redis) -> int:
    """How many connections the client's pool has made (idle or in use)."""
    pool = client.connection_pool
    return len(pool._available_connections) + len(pool._in_use_connections)  # type: ignore[attr-defined]


async def drop(client: redis.asyncio.Redis, prefix: str) -> None:
    async for key in client.scan_iter(match=f"{prefix}*"):
        await client.delete(key)


@pytest.fixture
async def shared(redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[redis.asyncio.Redis]:
    async with connect(redis_url, tmp_path) as client:
        try:
            yield client
        finally:
            await drop(client, prefix)


async def test_concurrent_callers_each_get_their_own_reply_on_one_connection(
    shared: redis.asyncio.Redis, prefix: str
) -> None:
    async def one(i: int) -> None:
        for j in range(20):
            assert await shared.eval("return ARGV[1]", 0, f"{i}:{j}") == f"{i}:{j}".encode()
            assert await shared.incr(f"{prefix}n") >= 1

    await asyncio.gather(*(one(i) for i in range(50)))
    assert await shared.get(f"{prefix}n") == b"1000"
    assert connections(shared) == 1  # 2,000 commands from 50 callers, one connection


async def test_replies_are_parsed_as_redis_py_parses_them(redis_url: str, prefix: str, tmp_path: Path) -> None:
    async def run(client: redis.asyncio.Redis, tag: str) -> list[object]:
        k = f"{prefix}{tag}"
        out: list[object] = [
            await client.set(f"{k}:s", "v"),
            await client.set(f"{k}:s", "w", nx=True),
            await client.hset(f"{k}:h", mapping={"a": 1, "b": "x"}),
            await client.hgetall(f"{k}:h"),
            await client.zadd(f"{k}:z", {"m1": 1.5, "m2": 2}),
            await client.zrange(f"{k}:z", 0, -1, withscores=True),
            await client.zscore(f"{k}:z", "m1"),
            await client.exists(f"{k}:s", f"{k}:nope"),
            await client.script_load("return 1"),
            await client.ping(),
            await client.smembers(f"{k}:nope"),
            await client.ttl(f"{k}:s"),
        ]
        async with client.pipeline(transaction=False) as pipe:
            pipe.hgetall(f"{k}:h").zrange(f"{k}:z", 0, -1, withscores=True).set(f"{k}:s", "z", get=True)
            out.append(await pipe.execute())
        return out

    async with connect(redis_url, tmp_path, share=False) as pooled, connect(redis_url, tmp_path) as shared:
        try:
            assert await run(shared, "shared") == await run(pooled, "pooled")
        finally:
            await drop(pooled, prefix)


async def test_an_error_reply_is_that_callers_error_and_the_connection_goes_on(
    shared: redis.asyncio.Redis, prefix: str
) -> None:
    await shared.set(f"{prefix}s", "text")
    results = await asyncio.gather(
        shared.hincrby(f"{prefix}s", "f", 1),  # a key of another type
        shared.get(f"{prefix}s"),
        shared.evalsha("0" * 40, 0),  # a script the server does not have
        return_exceptions=True,
    )
    assert isinstance(results[0], redis.exceptions.ResponseError) and "WRONGTYPE" in str(results[0])
    assert results[1] == b"text"
    assert isinstance(results[2], redis.exceptions.NoScriptError)
    script = shared.register_script(f"return 'loaded {uuid.uuid4().hex}'")  # not on the server yet
    assert (await script()).startswith(b"loaded")  # NOSCRIPT, then loaded and run: redis-py's own recovery
    assert connections(shared) == 1


async def test_a_pipeline_keeps_its_errors_in_place(shared: redis.asyncio.Redis, prefix: str) -> None:
    await shared.set(f"{prefix}s", "text")
    async with shared.pipeline(transaction=False) as pipe:
        pipe.get(f"{prefix}s").hincrby(f"{prefix}s", "f", 1).incr(f"{prefix}n")
        got = await pipe.execute(raise_on_error=False)
    assert got[0] == b"text" and isinstance(got[1], redis.exceptions.ResponseError) and got[2] == 1
    async with shared.pipeline(transaction=False) as pipe:
        pipe.get(f"{prefix}s").hincrby(f"{prefix}s", "f", 1)
        with pytest.raises(redis.exceptions.ResponseError, match=r"Command # 2 \(HINCRBY"):
            await pipe.execute()
    async with shared.pipeline(transaction=True) as pipe:  # a transaction keeps the pool
        pipe.incr(f"{prefix}n").incr(f"{prefix}n")
        assert await pipe.execute() == [2, 3]


async def test_a_cancelled_caller_leaves_the_connection_good(shared: redis.asyncio.Redis) -> None:
    await shared.ping()
    before = connections(shared)
    slow = asyncio.ensure_future(shared.eval(SPIN, 0, 200, "slow"))
    await asyncio.sleep(0.05)  # sent, and Redis is running it
    after_it = asyncio.ensure_future(shared.eval("return ARGV[1]", 0, "next"))
    await asyncio.sleep(0.01)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert await after_it == b"next"  # the slow reply was read and dropped, not given to this one
    assert await shared.eval("return ARGV[1]", 0, "again") == b"again"
    assert connections(shared) == before  # no reconnect


async def test_a_value_redis_py_refuses_fails_alone(shared: redis.asyncio.Redis, prefix: str) -> None:
    with pytest.raises(redis.exceptions.DataError):
        await shared.execute_command("SET", f"{prefix}k", object())
    assert await shared.set(f"{prefix}k", "v") is True


async def test_blocking_commands_keep_the_pool(shared: redis.asyncio.Redis, prefix: str) -> None:
    """A BLPOP waiting 1 s would hold every command behind it on a shared connection."""
    blocked = asyncio.ensure_future(shared.blpop([f"{prefix}list"], timeout=1))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(10):
        await shared.get(f"{prefix}k")
    assert loop.time() - t0 < 0.5
    assert not blocked.done()
    await shared.rpush(f"{prefix}list", "x")
    assert await blocked == (f"{prefix}list".encode(), b"x")


async def test_a_killed_connection_fails_what_was_in_flight_and_the_next_command_reconnects(
    redis_url: str, prefix: str
) -> None:
    name = f"mux-test-{uuid.uuid4().hex[:8]}"  # to find its connections among the server's
    client = redis.asyncio.Redis.from_url(redis_url, client_name=name)
    shared = mux.attach(client)
    assert shared is not None
    other = redis.asyncio.Redis.from_url(redis_url)
    try:
        await client.ping()
        ours = [c["id"] for c in await other.client_list() if c.get("name") == name]
        assert len(ours) == 1  # the shared connection
        async with other.client() as spinner, other.client() as killer:  # connected before the spin
            await spinner.ping()
            await killer.ping()
            spin = asyncio.ensure_future(spinner.eval(SPIN, 0, 300, "x"))
            await asyncio.sleep(0.05)  # Redis is busy: what is sent now waits in its socket buffers
            in_flight = asyncio.ensure_future(client.get(f"{prefix}k"))
            await asyncio.sleep(0.01)
            # Read after the spin, in the same turn of Redis as the GET: the GET is never answered.
            await killer.execute_command("CLIENT", "KILL", "ID", ours[0])
            with pytest.raises(redis.exceptions.ConnectionError):
                await in_flight
            await spin
        assert await client.eval("return ARGV[1]", 0, "back") == b"back"
    finally:
        await shared.aclose()
        await client.aclose()
        await other.aclose()


async def test_a_reply_later_than_the_socket_timeout_breaks_the_connection(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=0.2)
    shared = mux.attach(client)
    assert shared is not None
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            await client.eval(SPIN, 0, 600, "late")
        await asyncio.sleep(0.5)  # the script ends; its reply must not reach the next caller
        assert await client.eval("return ARGV[1]", 0, "fresh") == b"fresh"
    finally:
        await shared.aclose()
        await client.aclose()


async def test_closing_gives_the_client_back_its_pool(redis_url: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    shared = mux.attach(client)
    assert shared is not None
    try:
        await client.ping()
        assert "execute_command" in client.__dict__
        await shared.aclose()
        assert "execute_command" not in client.__dict__ and "pipeline" not in client.__dict__
        assert await client.ping() is True  # through the pool again
        assert client.connection_pool._available_connections  # type: ignore[attr-defined]
        assert not client.connection_pool._in_use_connections  # type: ignore[attr-defined]
    finally:
        await client.aclose()
