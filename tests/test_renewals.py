"""Batched lease renewals (bus.renewals): one pipeline per interval keeps every held job mark,
attempt lease and tenant slot of a process alive, and lets go of them when the holder is gone."""

from __future__ import annotations

import asyncio
import time

import pytest
from arq.connections import ArqRedis

from bus.attempts import AttemptStore, LeaseLost, claim_expired, now_ms
from bus.keys import Keys
from bus.renewals import AttemptLease, Expire, Renewals, TenantSlot
from bus.tenants import Tenants

TTL = 0.6  # seconds: renewed every 0.2 s


async def _lease_expiry(redis: ArqRedis, store: AttemptStore) -> int:
    return int(await redis.hget(store.lease_key, "expires_ms") or 0)  # type: ignore[misc]


async def test_one_pipeline_per_interval_keeps_every_held_item_alive(redis: ArqRedis, keys: Keys) -> None:
    """Three attempts, three job marks and a tenant slot held for 4 TTLs: all still alive at the end,
    renewed in one pipeline per interval (not one round trip per item)."""
    renewals = Renewals(redis)
    stores = [AttemptStore(redis, keys, "g1", f"t{i}", 1) for i in range(3)]
    for store in stores:
        assert await store.acquire("me", TTL)
    marks = [keys.job_id("execute", "g1", f"t{i}") for i in range(3)]
    for mark in marks:
        await redis.psetex(mark, int(TTL * 1000), b"1")
    tenants = Tenants(redis, keys)
    await tenants.acquire_slot("acme", "g1/t0", 2 * TTL)
    items = [
        *(AttemptLease(s, TTL) for s in stores),
        *(Expire(m, TTL) for m in marks),
        TenantSlot(tenants, "acme", "g1/t0", TTL),
    ]
    started = time.monotonic()
    async with renewals.hold(*items):
        await asyncio.sleep(4 * TTL)
        for store in stores:
            assert await _lease_expiry(redis, store) > now_ms()  # still held: no watchdog may take it
        for mark in marks:
            assert await redis.pttl(mark) > 0
        assert await redis.zscore(keys.tenant_running("acme"), "g1/t0") is not None
        assert not any(item.lost for item in items if isinstance(item, AttemptLease))
    elapsed = time.monotonic() - started
    # One round per period (TTL / 3), whatever the number of items held.
    assert 0 < renewals.rounds <= elapsed / (TTL / 3) + 1


async def test_a_dead_holders_lease_expires_and_a_watchdog_claims_it(redis: ArqRedis, keys: Keys) -> None:
    """A worker that dies stops renewing: its attempt's lease expires within the TTL and the
    watchdogs claim it for a resume; a live holder's lease in the same renewals is not claimable."""
    renewals = Renewals(redis)
    dead = AttemptStore(redis, keys, "g2", "dead", 1)
    live = AttemptStore(redis, keys, "g2", "live", 1)
    assert await dead.acquire("dead-worker", TTL) and await live.acquire("live-worker", TTL)
    async with renewals.hold(AttemptLease(live, TTL)):
        dying = asyncio.create_task(_hold_forever(renewals, AttemptLease(dead, TTL)))
        await asyncio.sleep(TTL / 2)
        dying.cancel()  # the worker holding it is gone: nothing renews it any more
        await asyncio.gather(dying, return_exceptions=True)
        await asyncio.sleep(TTL + 0.2)
        claimed = await claim_expired(redis, keys, 10, hold_for=TTL)
    assert claimed == [("g2", "dead", 1)]


async def test_a_lease_taken_over_is_dropped_not_renewed(redis: ArqRedis, keys: Keys) -> None:
    """When another executor took the attempt over (the epoch moved on), the renewal finds the lease
    lost: it stops renewing it and the old holder's next write raises LeaseLost."""
    renewals = Renewals(redis)
    old = AttemptStore(redis, keys, "g3", "t", 1)
    assert await old.acquire("old", TTL)
    lease = AttemptLease(old, TTL)
    async with renewals.hold(lease):
        await old.release()  # the epoch moves on, as when the lease is released or taken over
        new = AttemptStore(redis, keys, "g3", "t", 1)
        assert await new.acquire("new", TTL)
        await asyncio.sleep(TTL / 3 + 0.2)
        assert lease.lost
        held_by_new = await _lease_expiry(redis, new)
        await asyncio.sleep(TTL / 3 + 0.1)
        assert await _lease_expiry(redis, new) == held_by_new  # the old holder renewed nothing
    with pytest.raises(LeaseLost):
        await old.mark_started("call-1")


async def test_leaving_a_hold_stops_its_renewals(redis: ArqRedis, keys: Keys) -> None:
    """After the block, the item is renewed no more: a job mark left behind expires with its TTL."""
    renewals = Renewals(redis)
    mark = keys.job_id("execute", "g4", "t")
    await redis.psetex(mark, int(TTL * 1000), b"1")
    async with renewals.hold(Expire(mark, TTL)):
        await asyncio.sleep(TTL)
        assert await redis.exists(mark)
    await asyncio.sleep(TTL + 0.1)
    assert not await redis.exists(mark)


async def _hold_forever(renewals: Renewals, lease: AttemptLease) -> None:
    async with renewals.hold(lease):
        await asyncio.Event().wait()
