"""A real Sentinel deployment for tests: a primary, a replica and three Sentinels on loopback.

Each is a `redis-server` process (the Sentinels are `redis-server CONF --sentinel`) on a free port,
with its files in a temporary directory; `stop()` (or leaving the `with` block) kills every process
it started and reaps it. Used as:

    with SentinelCluster(tmp_path) as cluster:   # replicas=0, sentinels=0: one plain server
        url = cluster.url              # redis+sentinel://127.0.0.1:p1,.../mymaster/0
        old, new = cluster.failover()  # SENTINEL FAILOVER, returns once a Sentinel names the new master

The binary is `REDIS_SERVER_BINARY`, else the system's /usr/bin/redis-server (7.x), else
the first `redis-server` on PATH.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis as redis_lib

MASTER = "mymaster"


def redis_server_binary() -> str:
    candidates = (os.environ.get("REDIS_SERVER_BINARY"), "/usr/bin/redis-server", shutil.which("redis-server"))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return candidate
    raise RuntimeError("no redis-server binary: set REDIS_SERVER_BINARY")


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports. Their sockets are all held open until every port is picked: a port
    asked for and closed one at a time can be handed out again at once (CI once gave two Sentinels
    of one cluster the same port, and the second failed to bind)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class SentinelCluster:
    """A primary, `replicas` replicas and `sentinels` Sentinels (quorum 2) under `root`."""

    def __init__(self, root: Path, *, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1000) -> None:
        self.root = Path(root)
        self.binary = redis_server_binary()
        self.down_after_ms = down_after_ms
        ports = free_ports(1 + replicas + sentinels)
        self.data_ports = ports[: 1 + replicas]
        self.sentinel_ports = ports[1 + replicas :]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    # -- addresses --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/0"

    @property
    def primary_url(self) -> str:
        """The first primary's own address (what a client without Sentinel would be given)."""
        return f"redis://127.0.0.1:{self.data_ports[0]}/0"

    def client(self, port: int) -> redis_lib.Redis:
        return redis_lib.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)

    def master_port(self) -> int:
        """The master's port, as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis_lib.RedisError), self.client(port) as s:
                _host, master = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
                return int(master)
        raise RuntimeError("no Sentinel answers")

    def role(self, port: int) -> str:
        with self.client(port) as c:
            return str(c.info("replication")["role"])

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self, timeout: float = 30) -> SentinelCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        primary = self.data_ports[0]
        for i, port in enumerate(self.data_ports):
            lines = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {self._dir(port)}",
                "appendonly yes",
                "appendfsync everysec",
                'save ""',
                "maxmemory-policy noeviction",
                # Full syncs (the first, and the demoted master's) start at once.
                "repl-diskless-sync yes",
                "repl-diskless-sync-delay 0",
            ]
            if i > 0:
                lines.append(f"replicaof 127.0.0.1 {primary}")
            self._spawn(port, lines, sentinel=False)
        # Replicas in sync before the Sentinels start: a Sentinel's first INFO of the primary then
        # lists them (its next one comes 10 s later).
        self._wait(self._synced, timeout, "the replicas to sync from the primary")
        for port in self.sentinel_ports:
            lines = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {self._dir(port)}",
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2",
                f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
                f"sentinel failover-timeout {MASTER} 10000",
                f"sentinel parallel-syncs {MASTER} 1",
            ]
            self._spawn(port, lines, sentinel=True)
        if self.sentinel_ports:
            self._wait(self._ready, timeout, "the Sentinels to see the primary, its replicas and each other")
        return self

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()

    def __enter__(self) -> SentinelCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- faults ---------------------------------------------------------------------------------------
    def failover(self, timeout: float = 30) -> tuple[int, int]:
        """`SENTINEL FAILOVER`; returns (old master port, new master port) once the Sentinels name the new one."""
        old = self.master_port()

        def asked() -> bool:
            with self.client(self.sentinel_ports[0]) as s:
                try:
                    s.execute_command("SENTINEL", "FAILOVER", MASTER)
                except redis_lib.ResponseError as exc:
                    if "NOGOODSLAVE" in str(exc):  # the Sentinel's view of the replicas is not fresh yet
                        return False
                    raise
            return True

        self._wait(asked, timeout, "a Sentinel to accept SENTINEL FAILOVER")
        self._wait(lambda: self.master_port() != old, timeout, "the Sentinels to name a new master")
        return old, self.master_port()

    def wait_demoted(self, port: int, timeout: float = 30) -> None:
        """Wait until the server on `port` is a replica that has applied every write the master
        had when this was called. A link that is `up` is not enough: the replication stream still
        trails the master by whatever it wrote after the resync's snapshot."""
        with self.client(self.master_port()) as m:
            target = int(m.info("replication")["master_repl_offset"])

        def synced() -> bool:
            with self.client(port) as c:
                info = c.info("replication")
            return (
                info["role"] == "slave"
                and info.get("master_link_status") == "up"
                and int(info.get("slave_repl_offset", -1)) >= target
            )

        self._wait(synced, timeout, f"127.0.0.1:{port} to become a replica caught up with the master")

    def kill(self, port: int) -> None:
        """SIGKILL the server on `port`."""
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start the server on `port` again from its config and AOF (a killed master comes back as
        a master with stale data until Sentinel turns it into a replica)."""
        conf = self._dir(port) / "redis.conf"
        self.procs[port] = subprocess.Popen(
            [self.binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    # -- internals ----------------------------------------------------------------------------------
    def _dir(self, port: int) -> Path:
        path = self.root / str(port)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _spawn(self, port: int, lines: list[str], sentinel: bool) -> None:
        conf = self._dir(port) / ("sentinel.conf" if sentinel else "redis.conf")
        conf.write_text("\n".join([*lines, f"logfile {self._dir(port) / 'log.txt'}", ""]))
        args = [self.binary, str(conf), *(["--sentinel"] if sentinel else [])]
        self.procs[port] = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def _synced(self) -> bool:
        with self.client(self.data_ports[0]) as c:
            c.ping()
        for port in self.data_ports[1:]:
            with self.client(port) as c:
                if c.info("replication").get("master_link_status") != "up":
                    return False
        return True

    def _ready(self) -> bool:
        for port in self.sentinel_ports:
            with self.client(port) as s:
                state = s.execute_command("SENTINEL", "MASTER", MASTER)
                fields = dict(zip(state[::2], state[1::2], strict=True))
                if int(fields[b"num-slaves"]) < len(self.data_ports) - 1:
                    return False
                if int(fields[b"num-other-sentinels"]) < len(self.sentinel_ports) - 1:
                    return False
        return True

    def _wait(self, check: object, timeout: float, what: str) -> None:
        assert callable(check)
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            for port, proc in self.procs.items():
                if proc.poll() is not None and port not in self._killed():
                    log = self._dir(port) / "log.txt"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}:\n{tail}")
            try:
                if check():
                    return
            except (redis_lib.RedisError, OSError) as exc:
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"waited {timeout:g} s for {what}; last error: {last!r}")

    def _killed(self) -> set[int]:
        return {p for p, proc in self.procs.items() if proc.returncode is not None and proc.returncode < 0}
