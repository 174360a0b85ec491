"""A worker's Redis connections pack commands with hiredis's C packer (bus.connection): the bytes
on the wire and the errors are redis-py's own, and commands and pipelines round-trip through Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio
import redis.exceptions

from bus import connection
from bus.connection import FollowingConnection, PackingUnixConnection, connect

ARGS: list[tuple[object, ...]] = [
    ("SET", "k", "v"),
    ("EVALSHA", "a" * 40, 2, "k:1", "k:2", 1024, 0.1, 1e20, -3, b"\x00\xff", "é ünïcode"),
    ("CONFIG GET", "maxmemory"),  # a command name with a space is sent as two arguments
    (b"CLIENT SETNAME", "x"),
    ("HSET", "h", "f", ""),
]


@pytest.mark.skipif(connection._pack is None, reason="hiredis not installed")
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
