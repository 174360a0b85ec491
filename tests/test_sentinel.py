"""Sentinel: the `redis+sentinel://` URL, pools that follow the master across a failover, the
health report naming the master, and replica-acknowledged writes (`bus.durability`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from arq.connections import ArqRedis
from helpers import run_cli
from sentinel import SentinelCluster

from bus import durability
from bus.attempts import AttemptStore
from bus.connection import RedisUrlError, SentinelUrl, connect, master_address, parse_sentinel_url
from bus.effects import EffectRecord, SideEffects
from bus.keys import Keys
from bus.ledger import Ledger
from bus.retry import is_redis_trouble
from llm.types import Usage
from taskloom.settings import SettingsError, load_settings


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        (
            "redis+sentinel://h1:26380,h2/mymaster/2",
            SentinelUrl(sentinels=(("h1", 26380), ("h2", 26379)), master="mymaster", db=2),
        ),
        (
            "redis+sentinel://:s%40cret@[::1]:5000/main?sentinel_password=sp",
            SentinelUrl(sentinels=(("::1", 5000),), master="main", password="s@cret", sentinel_password="sp"),
        ),
        (
            "redis+sentinel://app:pw@h/m/?sentinel_username=mon&sentinel_password=x",
            SentinelUrl(
                sentinels=(("h", 26379),),
                master="m",
                username="app",
                password="pw",
                sentinel_username="mon",
                sentinel_password="x",
            ),
        ),
    ],
)
def test_a_sentinel_url_names_the_sentinels_the_master_and_the_passwords(url: str, parsed: SentinelUrl) -> None:
    """Hosts default to port 26379, %-escapes are decoded, the database defaults to 0."""
    assert parse_sentinel_url(url) == parsed


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h:26379", "expected the master's name"),
        ("redis+sentinel://h:26379/", "expected the master's name"),
        ("redis+sentinel://h:0/m", "expected a port between 1 and 65535 for Sentinel h"),
        ("redis+sentinel://h,,g/m", "expected host[:port] for each Sentinel"),
        ("redis+sentinel://h/m/zero", "expected /<master name>[/<database number>]"),
        ("redis+sentinel://h/m/0/x", "expected /<master name>[/<database number>]"),
        ("redis+sentinel://h/m?password=x", "unknown option 'password'"),
    ],
)
def test_a_bad_sentinel_url_stops_start_up_naming_what_is_wrong(url: str, message: str) -> None:
    """TASKLOOM_REDIS_URL is checked when settings load, with the reason in words."""
    with pytest.raises(RedisUrlError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_sentinel_url(url)
    with pytest.raises(SettingsError, match="TASKLOOM_REDIS_URL"):
        load_settings(redis_url=url)


def test_a_sentinel_url_never_shows_its_passwords() -> None:
    """The parsed form's repr (what a log or a traceback would print) holds no password."""
    shown = repr(parse_sentinel_url("redis+sentinel://:topsecret@h/m?sentinel_password=alsosecret"))
    assert "secret" not in shown and "h:26379/m/0" in shown


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    with SentinelCluster(tmp_path / "cluster") as c:
        yield c


@pytest.mark.chaos
async def test_a_pool_follows_the_master_across_sentinel_failover(cluster: SentinelCluster, tmp_path: Path) -> None:
    """After SENTINEL FAILOVER every write lands on the new master within a second or two: idle and
    busy connections are dropped (no write goes on to the old master until it is demoted), and the
    client never loops on READONLY."""
    async with connect(cluster.url, tmp_path) as redis:
        await redis.set("k", 0)
        old = cluster.master_port()
        assert master_address(redis) == ("127.0.0.1", old)
        errors: list[str] = []
        acked = 0
        stop = asyncio.Event()

        async def write_forever() -> None:
            nonlocal acked
            while not stop.is_set():
                try:
                    await redis.incr("k")
                    acked += 1
                except redis_lib.RedisError as exc:
                    assert is_redis_trouble(exc), exc  # what the job layer re-runs
                    errors.append(type(exc).__name__)
                await asyncio.sleep(0.005)

        writers = [asyncio.create_task(write_forever()) for _ in range(4)]
        await asyncio.sleep(0.3)
        _, new = await asyncio.to_thread(cluster.failover)
        await asyncio.sleep(2.0)  # the pool's master check runs every 0.5 s
        assert master_address(redis) == ("127.0.0.1", new)
        before = int(cluster.client(new).get("k") or 0)
        await asyncio.sleep(0.5)
        assert int(cluster.client(new).get("k") or 0) > before, "writes do not reach the new master"
        await asyncio.to_thread(cluster.wait_demoted, old)
        stop.set()
        await asyncio.gather(*writers)
        await asyncio.sleep(0.2)
        # Once the old master is a synced replica, every acknowledged write since the switch is on the
        # new master; what the old one acknowledged in the switch's window may be gone (at most the
        # writes of one master check).
        final = int(cluster.client(new).get("k") or 0)
        assert final <= acked and acked - final < 2000
        assert errors.count("ReadOnlyError") == 0


@pytest.mark.chaos
def test_health_names_the_master_the_sentinels_chose(cluster: SentinelCluster, subprocess_env: dict[str, str]) -> None:
    """`taskloom health` with a Sentinel URL says which node is master, before and after a failover."""
    env = dict(subprocess_env, TASKLOOM_REDIS_URL=cluster.url)
    first = json.loads(run_cli("health", "--role", "critic", "--json", env=env).stdout)
    assert first["master"]["address"] == f"127.0.0.1:{cluster.master_port()}"
    assert first["master"]["role"] == "master" and first["master"]["via_sentinel"] is True
    _, new = cluster.failover()
    after = run_cli("health", "--role", "critic", "--json", env=env)
    assert json.loads(after.stdout)["master"]["address"] == f"127.0.0.1:{new}"


def test_health_says_when_the_url_points_at_a_replica(cluster: SentinelCluster, subprocess_env: dict[str, str]) -> None:
    """A plain URL on a replica (where workers would loop on READONLY): unhealthy, naming the replica."""
    replica = cluster.data_ports[1]
    env = dict(subprocess_env, TASKLOOM_REDIS_URL=f"redis://127.0.0.1:{replica}/0")
    result = run_cli("health", "--role", "critic", env=env)
    assert result.returncode == 1
    assert f"Redis at 127.0.0.1:{replica} is a read-only replica" in result.stderr


async def test_guarded_writes_wait_for_replicas_and_fail_as_redis_trouble(redis: ArqRedis, keys: Keys) -> None:
    """With TASKLOOM_REDIS_WAIT_REPLICAS=1 on a Redis without a replica, no guarded write (side
    effect start and outcome, ledger reserve and settle, attempt lease) is confirmed: NotReplicated,
    which the job layer treats as Redis trouble (re-run later)."""
    effects = SideEffects(redis, keys)
    record = EffectRecord(key="charge:1", tool="charge", attempt=1, call_id="c1")
    assert await effects.begin("g", "t", record) is None  # no policy: no WAIT
    durability.require(redis, durability.ReplicaWait(replicas=1, timeout=0.05))
    try:
        with pytest.raises(durability.NotReplicated, match="side effect start: 0 of 1 replicas") as caught:
            await effects.begin("g", "t2", record)
        assert is_redis_trouble(caught.value)
        with pytest.raises(durability.NotReplicated, match="side effect outcome"):
            await effects.finish("g", "t", record.model_copy(update={"state": "ok"}))
        ledger = Ledger(redis, keys)
        await ledger.open("g", 10_000)
        with pytest.raises(durability.NotReplicated, match="ledger reserve"):
            await ledger.reserve("g", 100, 300)
        durability.require(redis, durability.OFF)
        reservation = await ledger.reserve("g", 100, 300)
        durability.require(redis, durability.ReplicaWait(replicas=1, timeout=0.05))
        with pytest.raises(durability.NotReplicated, match="ledger settle"):
            await ledger.settle(reservation, Usage(input_tokens=100, output_tokens=50))
        with pytest.raises(durability.NotReplicated, match="attempt lease"):
            await AttemptStore(redis, keys, "g", "t", 1).acquire("holder-a", 10)
    finally:
        durability.require(redis, durability.OFF)


async def test_guarded_writes_pass_once_the_replica_holds_them(cluster: SentinelCluster, tmp_path: Path) -> None:
    """With a replica in sync, a side effect's start is confirmed and readable from the replica at once."""
    keys = Keys(prefix="t:")
    async with connect(cluster.url, tmp_path, durability.ReplicaWait(replicas=1, timeout=2)) as redis:
        effects = SideEffects(redis, keys)
        record = EffectRecord(key="charge:1", tool="charge", attempt=1, call_id="c1")
        assert await effects.begin("g", "t", record) is None
        replica = cluster.data_ports[1]
        assert cluster.client(replica).hget(keys.side_effects("g", "t"), "state:charge:1") == b"started"
        # Two replicas asked of a deployment with one: refused, as a failover could lose the write.
        assert await AttemptStore(redis, keys, "g", "t", 1).acquire("holder-a", 10)
        assert cluster.client(replica).hget(keys.attempt_lease("g", "t", 1), "holder") == b"holder-a"
        durability.require(redis, durability.ReplicaWait(replicas=2, timeout=0.1))
        with pytest.raises(durability.NotReplicated, match="1 of 2 replicas"):
            await effects.begin("g", "t3", record)


@pytest.mark.parametrize("share", [False, True], ids=["pool", "shared connection"])
async def test_a_plain_url_connection_that_meets_readonly_is_dropped(
    cluster: SentinelCluster, tmp_path: Path, share: bool
) -> None:
    """A managed service's failover keeps the endpoint's name: a connection to the demoted primary
    answering READONLY is closed, so the next command resolves the name again (no READONLY loop).
    The same for the pool's connections and for the shared one (`bus.mux`), which goes back to the
    pool closed."""
    replica = cluster.data_ports[1]
    async with connect(f"redis://127.0.0.1:{replica}/0", tmp_path, share=share) as redis:
        with pytest.raises(redis_lib.exceptions.ReadOnlyError) as caught:
            await redis.set("k", 1)
        assert is_redis_trouble(caught.value)
        pool = redis.connection_pool
        for _ in range(100):  # the shared connection is handed back by a task of its own
            idle = list(pool._available_connections)  # type: ignore[attr-defined]
            if idle:
                break
            await asyncio.sleep(0.01)
        assert idle and not any(c.is_connected for c in idle)
        assert await redis.get("k") is None  # reads still work, on a new connection
