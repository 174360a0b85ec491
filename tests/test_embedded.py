"""The embedded redis-server: shared per home, AOF on, stopped after its last user, crash-tolerant."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
from helpers import live_redis_servers_under

from bus.connection import EmbeddedRedis


def test_two_users_share_one_server_and_the_last_one_stops_it(tmp_path: Path) -> None:
    """Two acquirers get the same server; it outlives the first release and stops at the second."""
    a, b = EmbeddedRedis(tmp_path), EmbeddedRedis(tmp_path)
    try:
        assert a.acquire() == b.acquire()
        assert len(live_redis_servers_under(tmp_path)) == 1
        assert not a.release()
        assert len(live_redis_servers_under(tmp_path)) == 1
        assert b.release()
        assert live_redis_servers_under(tmp_path) == []
    finally:
        a.release()
        b.release()


def test_aof_is_on_and_data_survives_a_restart(tmp_path: Path) -> None:
    """The embedded server runs with appendonly yes, so a value written before a stop is there after."""
    server = EmbeddedRedis(tmp_path)
    client = redis.Redis.from_url(server.acquire())
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    client.set("k", "v")
    client.close()
    assert server.release()
    client = redis.Redis.from_url(server.acquire())
    assert client.get("k") == b"v"
    client.close()
    server.release()


def test_a_killed_user_does_not_keep_the_server_alive(tmp_path: Path) -> None:
    """A process that dies by SIGKILL drops its claim (flock), so the last live user still stops the server."""
    code = (
        "import sys,time; from pathlib import Path; from bus.connection import EmbeddedRedis;"
        "EmbeddedRedis(Path(sys.argv[1])).acquire(); print('up', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        me = EmbeddedRedis(tmp_path)
        me.acquire()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(5)
        assert me.release()
        deadline = time.monotonic() + 5
        while live_redis_servers_under(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_redis_servers_under(tmp_path) == []
    finally:
        if child.poll() is None:
            child.kill()
