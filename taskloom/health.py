"""Worker heartbeats and `taskloom health`.

Every worker process records a heartbeat for each role it runs: one sorted set per role,
member `host:pid`, score = the time (ms) until which the beat counts as fresh, written every third of
`TASKLOOM_HEARTBEAT_TTL`. A worker that stops cleanly removes its members; one killed with SIGKILL
stops beating and is called dead once its score has passed. arq's own health-check key is one key
per queue that every worker of the role overwrites, so it cannot tell which worker is alive: a
container probe must ask about *its* worker (`--local`: members of this host, which in a container is
the container or pod name).

The beat runs on the worker's event loop, so a loop blocked by a runaway synchronous tool stops
beating too, and the orchestrator restarts that worker.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from bus import fleet
from bus.connection import RedisClient, master_address, server_answers, server_info
from bus.keys import ROLES, Keys

log = structlog.get_logger("taskloom.health")

def instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def heartbeat_forever(redis: RedisClient, keys: Keys, roles: Sequence[str], instance: str, ttl: float) -> None:
    """Beat now and every `ttl / 3` seconds; a failed beat (Redis away) is logged and retried."""
    while True:
        try:
            await fleet.beat(redis, keys, roles, instance, ttl)
        except Exception as exc:
            log.warning("heartbeat.failed", error=repr(exc))
        await asyncio.sleep(ttl / 3)


@dataclass
class WorkerBeat:
    instance: str
    fresh_for: float  # seconds the last beat stays fresh; negative: stale by that much (dead)

    @property
    def alive(self) -> bool:
        return self.fresh_for > 0


@dataclass
class Node:
    """The Redis server a client talks to: where it is, its role, its memory."""

    address: str  # host:port, or the unix socket
    role: str  # "master" or "slave" (Redis's words)
    via_sentinel: bool = False
    used_memory: int = 0
    maxmemory: int = 0  # 0: no limit
    policy: str = ""  # maxmemory-policy

    @property
    def memory_full(self) -> bool:
        # Past the limit, under noeviction, every write is refused with OOM (reads still work).
        return self.maxmemory > 0 and self.used_memory >= self.maxmemory

    def as_json(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "role": self.role,
            "via_sentinel": self.via_sentinel,
            "used_memory": self.used_memory,
            "maxmemory": self.maxmemory,
            "maxmemory_policy": self.policy,
            "memory_full": self.memory_full,
        }


async def node_of(redis: RedisClient) -> Node:
    """The server `redis` talks to (for a Sentinel-managed client: the master the Sentinels name)."""
    replication, memory = await server_info(redis)
    sentinel = master_address(redis)
    if sentinel is not None:
        address = f"{sentinel[0]}:{sentinel[1]}"
    else:
        kw = redis.connection_pool.connection_kwargs
        address = str(kw["path"]) if "path" in kw else f"{kw.get('host', '?')}:{kw.get('port', '?')}"
    return Node(
        address=address,
        role=str(replication.get("role", "?")),
        via_sentinel=sentinel is not None,
        used_memory=int(memory.get("used_memory", 0)),
        maxmemory=int(memory.get("maxmemory", 0)),
        policy=str(memory.get("maxmemory_policy", "")),
    )


@dataclass
class Report:
    redis: bool
    roles: dict[str, list[WorkerBeat]] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    node: Node | None = None

    @property
    def ok(self) -> bool:
        return self.redis and not self.reasons

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "redis": self.redis,
            "reasons": self.reasons,
            "master": None if self.node is None else self.node.as_json(),
            "roles": {
                role: {
                    "live": [b.instance for b in beats if b.alive],
                    "dead": [
                        {"instance": b.instance, "stale_for": round(-b.fresh_for, 1)} for b in beats if not b.alive
                    ],
                }
                for role, beats in self.roles.items()
            },
        }


async def check(redis: RedisClient, keys: Keys, roles: Sequence[str], host: str | None = None) -> Report:
    """Redis answers, and each of `roles` has a worker with a fresh heartbeat (on `host`, if given)."""
    try:
        await server_answers(redis)
    except Exception as exc:
        return Report(redis=False, reasons=[f"cannot reach Redis: {exc}"])
    report = Report(redis=True)
    try:
        report.node = await node_of(redis)
    except Exception as exc:  # a server without INFO (a proxy that hides it): not a reason to fail
        log.info("health.no_info", error=repr(exc))
    node = report.node
    if node is not None and node.role != "master":
        report.reasons.append(
            f"Redis at {node.address} is a read-only replica (role {node.role}): point TASKLOOM_REDIS_URL at the "
            "master, or at the Sentinels with redis+sentinel://"
        )
    if node is not None and node.memory_full:
        report.reasons.append(
            f"Redis memory is full ({node.used_memory} of {node.maxmemory} bytes, policy {node.policy}): writes are "
            "refused and workers wait; raise maxmemory or free memory (docs/operations.md)"
        )
    now = fleet.now_ms()
    for role in roles:
        beats = await _beats(redis, keys, role, now)
        if host is not None:
            beats = [b for b in beats if b.instance.rsplit(":", 1)[0] == host]
        report.roles[role] = beats
        if not any(b.alive for b in beats):
            where = f" on host {host}" if host is not None else ""
            last = max(beats, key=lambda b: b.fresh_for, default=None)
            seen = f" (the heartbeat of {last.instance} went stale {-last.fresh_for:.1f} s ago)" if last else ""
            report.reasons.append(f"no live {role} worker{where}{seen}")
    return report


async def _beats(redis: RedisClient, keys: Keys, role: str, now: int) -> list[WorkerBeat]:
    return [WorkerBeat(m, (expiry - now) / 1000) for m, expiry in await fleet.heartbeats(redis, keys, role)]


@dataclass(frozen=True)
class RoleLoad:
    """One role as the fleet view (`GET /v1/fleet`) shows it."""

    role: str
    live_workers: int  # workers with a fresh heartbeat, as `check` counts them
    queue_depth: int  # jobs in the role's queue: waiting, deferred or running (`taskloom_queue_depth`)
    oldest_queued_age_s: float | None  # how long the longest-waiting due job has waited; None: none waits


async def load(redis: RedisClient, keys: Keys, roles: Sequence[str] = ROLES) -> list[RoleLoad]:
    """Each role's live workers, queue depth and longest wait. Redis errors propagate (the caller
    answers them: the API with a 503)."""
    now = fleet.now_ms()
    depths = await fleet.queue_depths(redis, keys, roles)
    out = []
    for role in roles:
        beats = await _beats(redis, keys, role, now)
        due = await fleet.oldest_waiting(redis, keys, role, now)
        out.append(
            RoleLoad(
                role=role,
                live_workers=sum(1 for b in beats if b.alive),
                queue_depth=depths[role],
                oldest_queued_age_s=None if due is None else round(max(0, now - due) / 1000, 3),
            )
        )
    return out


async def missing_roles(redis: RedisClient, keys: Keys, roles: Sequence[str]) -> list[str]:
    """The roles in `roles` with no live worker anywhere (no fresh heartbeat); [] if Redis cannot tell."""
    try:
        report = await check(redis, keys, roles)
    except Exception:
        return []
    return [role for role, beats in report.roles.items() if not any(b.alive for b in beats)]


def no_worker_message(missing: Sequence[str]) -> str:
    return (
        f"no live {', '.join(missing)} worker (no fresh heartbeat in Redis): the goal waits until one starts; "
        "start them with `taskloom worker all` (or use `taskloom run --local`)"
    )
