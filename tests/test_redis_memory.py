"""Redis out of memory (maxmemory reached under noeviction) and the kinds of Redis trouble: the fleet
waits it out without exiting or half-writing, says so once, and `taskloom health` names it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.exceptions
from helpers import eventually
from sentinel import SentinelCluster
from structlog.testing import capture_logs

from bus.client import Client
from bus.connection import connect
from bus.durability import NotReplicated
from bus.effects import EffectRecord, SideEffects
from bus.keys import ROLES
from bus.retry import Episode, redis_trouble
from llm import DemoModel
from taskloom import health
from taskloom.settings import Settings, keys_for
from taskloom.workers import run_workers

DEMO_GOAL = "Can orders A100 and A101 be refunded? Today is 2026-10-13."


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "memory_full"),
        (
            redis.exceptions.ResponseError("Error running script: OOM command not allowed when used memory"),
            "memory_full",
        ),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), "read_only"),
        (redis.exceptions.ConnectionError("Connection closed by server."), "unreachable"),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), "unreachable"),
        (redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas to write."), "unreachable"),
        (redis.exceptions.ResponseError("MASTERDOWN Link with MASTER is down"), "unreachable"),
        (NotReplicated("ledger settle", 0, 1, 0.5), "not_replicated"),
        (redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), None),
        (ValueError("a bug"), None),
    ],
)
def test_redis_trouble_kinds(exc: BaseException, kind: str | None) -> None:
    """OOM and READONLY are told by class (redis-py strips their code) or wrapped text; a bug is no trouble."""
    assert redis_trouble(exc) == kind


def test_an_episode_is_logged_once_until_it_has_been_quiet() -> None:
    """Occurrences closer than `quiet` seconds belong to one episode; a later one starts another."""
    episode = Episode(quiet=30)
    assert [episode.seen(t) for t in (0, 1, 29, 58, 100, 101)] == [True, False, False, False, True, False]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SentinelCluster]:
    with SentinelCluster(tmp_path / "redis", replicas=0, sentinels=0) as s:
        yield s


async def test_a_refused_side_effect_start_writes_nothing(server: SentinelCluster, tmp_path: Path) -> None:
    """Under OOM the claim script is refused whole: no `started` record that would block the call later."""
    keys = keys_for(Settings(redis_url=server.primary_url, key_prefix="m:", home=tmp_path))
    async with connect(server.primary_url, tmp_path) as r:
        server.client(server.data_ports[0]).config_set("maxmemory", 1)
        record = EffectRecord(key="charge:1", tool="charge", attempt=1, call_id="c1")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            await SideEffects(r, keys).begin("g", "t", record)
        assert await r.hgetall(keys.side_effects("g", "t")) == {}


async def test_a_fleet_waits_out_full_memory_and_the_goal_then_succeeds(
    server: SentinelCluster, tmp_path: Path
) -> None:
    """maxmemory reached while a goal runs: its jobs are refused and re-run with backoff, no worker
    exits, the trouble is logged once (not once per job or per poll), health names full memory;
    once memory is freed the goal succeeds."""
    settings = Settings(redis_url=server.primary_url, key_prefix="m:", poll_delay=0.01, home=tmp_path / "home")
    admin = server.client(server.data_ports[0])
    stop = asyncio.Event()
    with capture_logs() as logs:
        fleet = asyncio.create_task(
            run_workers(list(ROLES), settings, stop=stop, model=DemoModel(latency=0.3), signals=False)
        )
        try:
            async with connect(settings.redis_url, settings.home) as r:
                keys = keys_for(settings)

                async def ready() -> bool:
                    return not await health.missing_roles(r, keys, ROLES)

                await eventually(ready, timeout=30)
                client = Client(r, keys, default_budget_tokens=100_000)
                gid = await client.submit(DEMO_GOAL)
                await asyncio.sleep(0.5)  # the planner's model call is in flight
                admin.config_set("maxmemory", 1)
                await asyncio.sleep(4)
                assert not (await client.get(gid)).terminal
                report = await health.check(r, keys, ROLES)
                assert any(reason.startswith("Redis memory is full") for reason in report.reasons), report.reasons
                assert report.node is not None and report.node.memory_full
                assert not fleet.done(), "a worker exited"
                admin.config_set("maxmemory", 0)
                record = await client.wait(gid, timeout=30)
                assert record.state.value == "succeeded", record
        finally:
            admin.config_set("maxmemory", 0)
            stop.set()
            await asyncio.wait_for(fleet, 30)
    trouble = [e for e in logs if e["event"] == "redis.trouble"]
    assert [e["kind"] for e in trouble] == ["memory_full"], trouble
    assert "maxmemory" in trouble[0]["hint"]
    retries = [e for e in logs if e["event"] == "job.retry"]
    assert retries and all(e["log_level"] == "info" and e["cause"] == "redis" for e in retries)
    warned = [e for e in logs if e["event"] == "worker.poll_failed" and e["log_level"] == "warning"]
    assert len(warned) <= len(ROLES), warned  # at most one per worker loop and episode
