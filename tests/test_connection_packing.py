"""A worker's Redis connections pack commands with hiredis's C packer (bus.connection): the bytes
on the wire and the errors are redis-py's own, and commands and pipelines round-trip through Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio
import redis.exceptions

from bus import connection, mux
from bus.connection import FollowingConnection, PackingUnixConnection, connect

ARGS: list[tuple[object, ...]] = [
    ("SET", "k", "v"),
    ("EVALSHA", "a" * 40, 2, "k:1", "k:2", 1024, 0.1, 1e20, -3, b"\x00\xff", "é ünïcode"),
    ("CONFIG GET", "maxmemory"),  # a command name with a space is sent as two arguments
    (b"CLIENT SETNAME", "x"),
    ("HSET", "h", "f", ""),
]


@pytest.mark.skipif(not mux.HIREDIS, reason="hiredis not installed")
@pytest.mark.parametrize("args", ARGS)
def test_the_same_bytes_as_redis_py(args: tuple[object, ...]) -> None:
    ours = FollowingConnection()
    theirs = redis.asyncio.Connection()
    assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))


@pytest.mark.parametrize("bad", [True, object(), None])
def test_a_value_redis_py_refuses_is_refused_alike(bad: object) -> None:
    with pytest.raises(redis.exceptions.DataError):
        FollowingConnection().pack_command("SET", "k", bad)


async def test_commands_and_pipelines_round_trip(redis_url: str, prefix: str, tmp_path: Path) -> None:
    async with connect(redis_url, tmp_path) as pool:
        assert pool.connection_pool.connection_class in (FollowingConnection, PackingUnixConnection)
        key = f"{prefix}packed"
        try:
            await pool.hset(key, mapping={"f": 0.1, "n": 7, "b": b"\x00\xff", "u": "é"})
            async with pool.pipeline(transaction=True) as pipe:
                pipe.hincrbyfloat(key, "f", 0.2)
                pipe.hgetall(key)
                _, got = await pipe.execute()
            assert got == {b"f": b"0.3", b"n": b"7", b"b": b"\x00\xff", b"u": "é".encode()}
            assert await pool.eval("return ARGV[1] .. ARGV[2]", 0, 1.5, "x") == b"1.5x"
        finally:
            await pool.delete(key)


async def test_a_connection_with_unread_data_is_not_reused_as_is(redis_url: str, tmp_path: Path) -> None:
    """The pool's check before a command skips its socket read only when nothing is buffered: a reply
    left unread, or a connection the server closed, still makes the pool reconnect, and the next
    command gets its own reply."""
    async with connect(redis_url, tmp_path) as pool:
        conn = await pool.connection_pool.get_connection()
        await conn.send_command("ECHO", "stale")  # its reply is never read
        await asyncio.sleep(0.05)  # the reply reaches the stream's buffer
        await pool.connection_pool.release(conn)
        assert await pool.echo("fresh") == b"fresh"

        conn = await pool.connection_pool.get_connection()
        own_id = await conn.send_command("CLIENT", "ID") or await conn.read_response()
        await pool.connection_pool.release(conn)
        async with connect(redis_url, tmp_path) as other:
            assert await other.execute_command("CLIENT", "KILL", "ID", own_id) == 1
        await asyncio.sleep(0.05)  # the close reaches the stream
        assert await pool.echo("after close") == b"after close"


async def test_the_check_skips_the_read_when_nothing_is_buffered(redis_url: str, tmp_path: Path) -> None:
    async with connect(redis_url, tmp_path) as pool:
        await pool.echo("x")  # ECHO keeps the pool (bus.mux.SHARED)
        (conn,) = pool.connection_pool._available_connections
        if not isinstance(conn._parser, connection._HiredisParser):
            pytest.skip("hiredis not installed")
        assert await conn.can_read_destructive() is False
