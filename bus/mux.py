"""One shared connection for a process's short commands, with the replies matched to their
commands in order: no pool, no connection per command in flight.

Through redis-py's pool, every command in flight holds a connection of its own and makes its own
`send` and `recv`, and its client side (the pool's lock, the retry wrapper, the connection checks)
costs some 55-75 µs of CPU on a small machine, most of a round trip's. Here a command is packed
(hiredis), written, and answered by a future: the connection's protocol (`_Link`) matches replies
to their commands first in, first out (Redis answers each connection in order), and while Redis is
busy its replies to several callers arrive in one read.

What goes on the shared connection (`SHARED`): short data commands and scripts, and
non-transactional pipelines made only of them. Everything else keeps the pool, where each command
has a connection to itself: commands that block (`BLPOP`, `XREAD`, `WAIT` for replicas), that change
the connection's state (`WATCH`, `MULTI`, `SELECT`, `CLIENT`, subscriptions), transactions (arq's
enqueue and pick-up), and pipelines that end in `WAIT` (`bus.durability`), since `WAIT` counts the
writes of its own connection only.

Failures. The shared connection is one of the pool's, borrowed for as long as it works: the pool
made it (address, Sentinel's master, TLS, AUTH, SELECT) and follows a failover by closing it
(`bus.connection.follow_master`). When it closes or breaks, every command waiting on it fails with
`ConnectionError`, as a command in flight on a lost pool connection does, and the next command
borrows a fresh one. A `READONLY` reply (the server was demoted) is that command's error and closes
the connection, so no later command goes to the old primary. A caller cancelled while its reply is
on the way leaves its place in the queue: the reply is read and dropped, and the connection stays
good (the pool has to close a connection whose reply was abandoned). The pool's `socket_timeout`,
when one is set, is honoured here too: a reply that has not come in that time breaks the connection.
Needs hiredis (a dependency of taskloom); without it every command keeps the pool.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio
import redis.exceptions
from redis._parsers import BaseParser
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import Connection
from redis.client import EMPTY_RESPONSE, NEVER_DECODE

try:  # installed with taskloom; optional for the code, which falls back to the pool without it
    import hiredis
except ImportError:  # pragma: no cover - exercised where hiredis is not installed
    hiredis = None  # type: ignore[assignment]
HIREDIS: bool = hiredis is not None  # the shared connection and the C packer need it

# Commands that are answered at once with one reply and leave the connection as they found it.
SHARED = frozenset(
    """
    EVALSHA EVAL EVALSHA_RO EVAL_RO FCALL FCALL_RO
    GET SET SETEX PSETEX SETNX GETDEL GETEX MGET MSET INCR INCRBY DECR DECRBY INCRBYFLOAT APPEND STRLEN
    DEL UNLINK EXISTS EXPIRE PEXPIRE EXPIREAT PEXPIREAT PERSIST TTL PTTL TYPE
    HGET HSET HSETNX HMGET HMSET HGETALL HDEL HEXISTS HINCRBY HINCRBYFLOAT HKEYS HVALS HLEN
    SADD SREM SMEMBERS SISMEMBER SMISMEMBER SCARD
    ZADD ZREM ZSCORE ZMSCORE ZCARD ZCOUNT ZINCRBY ZRANK ZREVRANK ZRANGE ZREVRANGE ZRANGEBYSCORE
    ZREVRANGEBYSCORE ZREMRANGEBYSCORE ZREMRANGEBYRANK ZPOPMIN ZPOPMAX
    LPUSH RPUSH LPOP RPOP LRANGE LLEN LINDEX LREM LTRIM
    XADD XRANGE XREVRANGE XLEN XTRIM XACK XDEL
    PUBLISH PING TIME
    """.split()
) | {"SCRIPT LOAD", "SCRIPT EXISTS"}

_ReadOnly = redis.exceptions.ReadOnlyError
# Commands whose replies redis-py passes through as they are (it has no callback for them).
_SCRIPT_CALLS = frozenset({"FCALL", "EVALSHA"})
# Replies owed above which the commands of a loop turn share one write (`_Link.send`), and the most
# commands one such write waits for: a turn that runs hundreds of tasks' steps (1,000 tasks starting
# at once) would otherwise hold its first commands back until its end, with Redis idle meanwhile.
BUSY = 16
BATCH = 32
_ResponseError = redis.exceptions.ResponseError


def pack(args: Sequence[Any]) -> bytes:
    """One command in Redis's protocol, as redis-py would write it (a command name with spaces
    split, floats as `repr`); a value redis-py would refuse (a bool, an object) raises its
    `DataError`. Needs hiredis."""
    first = args[0]
    if isinstance(first, str):
        if " " in first:
            args = (*first.split(), *args[1:])
    elif b" " in first:
        args = (*first.split(), *args[1:])
    try:
        packed: bytes = hiredis.pack_command(tuple(args))
    except TypeError as exc:
        raise redis.exceptions.DataError(str(exc)) from None
    return packed


class _Group:
    """The replies owed to one pipeline: `count` of them, in order, for one future."""

    __slots__ = ("count", "future", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], count: int) -> None:
        self.future, self.count = future, count
        self.replies: list[Any] = []


class _Link(asyncio.Protocol):
    """One borrowed connection, and the replies it owes, oldest first.

    It becomes its transport's protocol: the event loop hands it the bytes Redis sends as they
    arrive (`data_received`), and the callers' futures are answered there, with no reader task in
    between (a task's turn per read cost more than the rest of a command's reading). The stream
    protocol redis-py built is still told when the connection is lost, so that redis-py's own
    `disconnect` finishes as it would."""

    def __init__(self, mux: Multiplexer, conn: Connection) -> None:
        self.mux = mux
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        assert conn._writer is not None  # a connected connection
        self.transport: asyncio.WriteTransport = conn._writer.transport
        encoder = conn.encoder
        options: dict[str, Any] = {
            "protocolError": redis.exceptions.InvalidResponse,
            "replyError": BaseParser.parse_error,
        }
        if encoder.decode_responses:
            options["encoding"], options["errors"] = encoder.encoding, encoder.encoding_errors
        self.parser = hiredis.Reader(**options)
        self.pending: collections.deque[Any] = collections.deque()  # futures and _Groups
        self.out: list[bytes] = []  # the bytes of this loop turn, when they wait for its end
        self.sent: collections.deque[float] = collections.deque()  # when each was queued (timeouts only)
        self.broken: BaseException | None = None
        self.timeout = conn.socket_timeout
        self._timer: asyncio.TimerHandle | None = None
        self._streams = self.transport.get_protocol()
        self.transport.set_protocol(self)

    # -- sending ----------------------------------------------------------------------------------

    def send(self, data: bytes, entry: Any) -> None:
        """Write `data` (one or more packed commands); `entry` (a future, or a `_Group`) is answered
        by its reply or replies.

        While few replies are owed, the bytes go out at once: holding them back to the end of the
        loop turn, to write a turn's commands together, would leave Redis idle while the turn runs
        and move the callers in lockstep with it (measured: a third fewer ledger pairs per second
        at 10 concurrent callers). With more than `BUSY` owed, Redis has that much work queued
        already: the commands of the turn then share a write, `BATCH` at a time (a `send` each
        would cost more than the rest of a command's client CPU)."""
        self.pending.append(entry)
        if self.timeout is not None:
            self.sent.append(time.monotonic())
            if self._timer is None:
                self._timer = self.loop.call_later(self.timeout, self._check_timeout)
        if self.out or len(self.pending) > BUSY:
            if not self.out:
                self.loop.call_soon(self._flush)
            self.out.append(data)
            if len(self.out) >= BATCH:  # a long turn must not keep Redis waiting for its end
                self._flush()
            return
        self._write(data)

    def _flush(self) -> None:
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.broken is not None:
            return
        try:
            if self.transport.is_closing():
                raise redis.exceptions.ConnectionError("Connection closed.")
            self.transport.write(data)
        except Exception as exc:
            self.fail(_as_connection_error(exc, "writing to"))

    # -- receiving (asyncio.Protocol) -------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.broken is not None:
            return
        try:
            self.parser.feed(data)
            while (reply := self.parser.gets()) is not False:
                self._answer(reply)
                if isinstance(reply, _ReadOnly):
                    # A demoted primary: this command has its error; no other goes there.
                    raise redis.exceptions.ConnectionError("the server answered READONLY (it was demoted)")
        except Exception as exc:
            self.fail(_as_connection_error(exc, "reading from"))

    def eof_received(self) -> bool:
        self.fail(redis.exceptions.ConnectionError("Connection closed by server."))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(
            _as_connection_error(exc, "reading from") if exc else redis.exceptions.ConnectionError("Connection closed.")
        )
        self._streams.connection_lost(exc)  # redis-py's disconnect waits for its stream's close

    def _answer(self, reply: Any) -> None:
        if not self.pending:
            raise redis.exceptions.InvalidResponse("a reply that no command is waiting for")
        entry = self.pending[0]
        if type(entry) is _Group:
            entry.replies.append(reply)
            if len(entry.replies) < entry.count:
                return
            self.pending.popleft()
            if not entry.future.done():
                entry.future.set_result(entry.replies)
        else:
            self.pending.popleft()
            if not entry.done():  # a cancelled caller: its reply is dropped
                entry.set_result(reply)
        if self.sent:
            self.sent.popleft()

    def _check_timeout(self) -> None:
        self._timer = None
        if self.broken is not None or not self.sent or self.timeout is None:
            return
        late = time.monotonic() - self.sent[0]
        if late >= self.timeout:
            self.fail(redis.exceptions.TimeoutError(f"Timeout reading from the shared connection ({self.timeout} s)"))
        else:
            self._timer = self.loop.call_later(self.timeout - late, self._check_timeout)

    # -- breaking ---------------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """Break the link: every command still owed a reply fails with `exc`; the connection goes
        back to the pool, closed."""
        if self.broken is not None:
            return
        self.broken = exc
        self.out.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.pending:
            entry = self.pending.popleft()
            future = entry.future if type(entry) is _Group else entry
            if not future.done():
                future.set_exception(exc)
        self.mux._lost(self)


def _as_connection_error(exc: BaseException, doing: str) -> BaseException:
    if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return exc
    return redis.exceptions.ConnectionError(f"Error while {doing} Redis: {exc!r}")


class Multiplexer:
    """The shared connection of one client (`attach`); its pool keeps everything not in `SHARED`."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._pool_execute: Callable[..., Any] = client.execute_command
        self._link: _Link | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._retiring: set[asyncio.Task[None]] = set()

    # -- one command ------------------------------------------------------------------------------

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name = args[0]
        if name not in SHARED or NEVER_DECODE in options or self._closed:
            return await self._pool_execute(*args, **options)
        data = pack(args)  # before a connection is taken: bad input fails alone
        link = self._link or await self._connect()
        future: asyncio.Future[Any] = link.loop.create_future()
        link.send(data, future)
        reply = await future
        if isinstance(reply, _ResponseError):
            if EMPTY_RESPONSE in options:
                return options[EMPTY_RESPONSE]
            raise reply
        # Scripts (no callback in redis-py: a set lookup instead of its case-insensitive dict's),
        # most reads: no coroutine more per reply.
        if name in _SCRIPT_CALLS or name not in self.client.response_callbacks:
            return reply
        return await self._parsed(name, reply, options)

    async def _parsed(self, name: str, reply: Any, options: dict[str, Any]) -> Any:
        """redis-py's reply callbacks, as its `parse_response` applies them."""
        callback = self.client.response_callbacks.get(name)
        if callback is None:
            return reply
        options.pop(EMPTY_RESPONSE, None)
        options.pop("keys", None)
        out = callback(reply, **options)
        return await out if inspect.isawaitable(out) else out

    # -- pipelines --------------------------------------------------------------------------------

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        client = self.client
        return SharingPipeline(self, client.connection_pool, client.response_callbacks, transaction, shard_hint)

    async def run_pipeline(self, pipe: Pipeline, raise_on_error: bool) -> list[Any]:
        """A non-transactional pipeline of `SHARED` commands, on the shared connection."""
        stack = pipe.command_stack
        data = b"".join(pack(args) for args, _ in stack)
        link = self._link or await self._connect()
        future: asyncio.Future[list[Any]] = link.loop.create_future()
        link.send(data, _Group(future, len(stack)))
        replies = await future
        response: list[Any] = []
        callbacks = self.client.response_callbacks
        for (args, options), reply in zip(stack, replies, strict=True):
            name = args[0] if isinstance(args[0], str) else str(args[0])
            if isinstance(reply, _ResponseError):
                response.append(options[EMPTY_RESPONSE] if EMPTY_RESPONSE in options else reply)
            elif name in _SCRIPT_CALLS or name not in callbacks:  # as `execute_command`: no coroutine more
                response.append(reply)
            else:
                response.append(await self._parsed(name, reply, dict(options)))
        if raise_on_error:
            pipe.raise_first_error(stack, response)
        return response

    # -- the connection ---------------------------------------------------------------------------

    async def _connect(self) -> _Link:
        async with self._lock:
            if self._link is None or self._link.broken is not None:
                if self._closed:
                    raise redis.exceptions.ConnectionError("the client is closed")
                pool = self.client.connection_pool
                try:
                    conn = await pool.get_connection()
                except TypeError:  # redis-py before 5.3 wants a command name (and ignores it)
                    conn = await pool.get_connection("_")
                self._link = _Link(self, conn)
            return self._link

    def _lost(self, link: _Link) -> None:
        if self._link is link:
            self._link = None
        task = asyncio.ensure_future(self._retire(link))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, link: _Link) -> None:
        try:
            await link.conn.disconnect()
        finally:
            await self.client.connection_pool.release(link.conn)

    async def aclose(self) -> None:
        """Stop sharing: fail what is still owed a reply, give the connection back, and leave the
        client as it was."""
        self._closed = True
        if self._link is not None:
            self._link.fail(redis.exceptions.ConnectionError("the client is closed"))
        while self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)
        for name in ("execute_command", "pipeline"):
            self.client.__dict__.pop(name, None)


class SharingPipeline(Pipeline):
    """A pipeline that goes on the shared connection when it can (`Multiplexer.run_pipeline`): not
    a transaction, no `WATCH`, no registered-script objects, every command in `SHARED`."""

    def __init__(self, mux: Multiplexer, *args: Any) -> None:
        super().__init__(*args)
        self.mux = mux

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = self.command_stack
        if (
            not stack
            or self.is_transaction
            or self.explicit_transaction
            or self.watching
            or self.scripts
            or self.connection is not None
            or self.mux._closed
            or any(args[0] not in SHARED or NEVER_DECODE in options for args, options in stack)
        ):
            return await super().execute(raise_on_error)
        try:
            return await self.mux.run_pipeline(self, raise_on_error)
        finally:
            await self.reset()  # type: ignore[no-untyped-call]


def attach(client: redis.asyncio.Redis) -> Multiplexer | None:
    """Send `client`'s `SHARED` commands and pipelines on one shared connection from now on (None,
    and nothing changed, without hiredis). Undo with `Multiplexer.aclose`."""
    if not HIREDIS:
        return None
    mux = Multiplexer(client)
    client.execute_command = mux.execute_command  # type: ignore[method-assign]
    client.pipeline = mux.pipeline  # type: ignore[method-assign]
    return mux
