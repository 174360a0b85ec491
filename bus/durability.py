"""Writes that must reach a replica before taskloom acts on them (Redis `WAIT`).

Replication is asynchronous: a failover may lose the last writes the old master acknowledged. For
most of taskloom's writes a loss is repaired by re-running an idempotent job (docs/internals.md,
"Failover: what a lost write costs"); for a few it is not: the record that a side effect is about
to start (lost, a later attempt would run the side effect again), its outcome, a ledger reservation
and close (lost, the goal's spending would go uncounted), and an attempt's lease (lost, two
executors could hold the same epoch). Those writes go through `confirmed` (or a guarded
`bus.batch.ScriptCall`), which sends the write and `WAIT <replicas> <timeout>` in one pipeline, on one
connection (`WAIT` counts the writes of the connection that sends it), and raises `NotReplicated`
when fewer replicas acknowledged in time. `NotReplicated` is a lost connection to the job layer
(`bus.retry.is_redis_trouble`): the job re-runs later, and the record's state decides what the
re-run may do, as after a crash.

The policy belongs to a connection pool (`require`, done by `bus.connection.connect` from
`TASKLOOM_REDIS_WAIT_REPLICAS`): 0 replicas (the default) sends no `WAIT`, right for a single Redis
with AOF, where there is no replica to lose a write to.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .scripts import Script


@dataclass(frozen=True)
class ReplicaWait:
    replicas: int = 0  # replicas that must hold a guarded write; 0: no WAIT
    timeout: float = 0.5  # seconds WAIT blocks at most

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")

    @property
    def timeout_ms(self) -> int:
        return max(1, round(self.timeout * 1000))


OFF = ReplicaWait()


class NotReplicated(redis.exceptions.ConnectionError):
    """A guarded write reached fewer replicas than required in time: it may be lost by a failover."""

    def __init__(self, what: str, acked: int = 0, wanted: int = 0, timeout: float = 0.0) -> None:
        super().__init__(
            f"{what}: {acked} of {wanted} replicas acknowledged it within {timeout:g} s "
            "(TASKLOOM_REDIS_WAIT_REPLICAS, TASKLOOM_REDIS_WAIT_TIMEOUT)"
        )
        self.what, self.acked, self.wanted, self.timeout = what, acked, wanted, timeout

    def __reduce__(self) -> tuple[Any, ...]:  # errors cross arq pickled
        return (NotReplicated, (self.what, self.acked, self.wanted, self.timeout))


_POLICIES: weakref.WeakKeyDictionary[Redis, ReplicaWait] = weakref.WeakKeyDictionary()


def require(client: Redis, policy: ReplicaWait) -> None:
    """Guarded writes on `client` wait for `policy.replicas` replicas."""
    _POLICIES[client] = policy


def policy_of(client: Redis) -> ReplicaWait:
    return _POLICIES.get(client, OFF)


async def confirmed(client: Redis, what: str, queue: Callable[[Pipeline], None]) -> Any:
    """Run the write(s) `queue` adds to a pipeline; with a policy, `WAIT` for replicas after them.

    Returns the first command's reply (an exception object if it failed). Raises `NotReplicated`
    when too few replicas acknowledged.
    """
    policy = policy_of(client)
    async with client.pipeline(transaction=False) as pipe:
        queue(pipe)
        if policy.replicas:
            pipe.wait(policy.replicas, policy.timeout_ms)
        replies = await pipe.execute(raise_on_error=False)
    if isinstance(replies[0], Exception):
        return replies[0]  # nothing was written: no replica to wait for
    for reply in replies[1:]:
        if isinstance(reply, Exception):
            raise reply
    if policy.replicas and int(replies[-1]) < policy.replicas:
        raise NotReplicated(what, int(replies[-1]), policy.replicas, policy.timeout)
    return replies[0]


async def script_confirmed(
    client: Redis, what: str, script: Script, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """Run a registered Lua script as a guarded write: with a policy, EVALSHA and WAIT in one round
    trip (redis-py's own pipelined scripts would first ask SCRIPT EXISTS, a second one)."""
    if policy_of(client).replicas == 0:
        return await script(keys=keys, args=args)

    def queue(pipe: Pipeline) -> None:
        pipe.evalsha(script.sha, len(keys), *keys, *args)

    reply = await confirmed(client, what, queue)
    if isinstance(reply, redis.exceptions.NoScriptError):  # a new or flushed server: load it, once
        await client.script_load(script.script)
        reply = await confirmed(client, what, queue)
    if isinstance(reply, Exception):
        raise reply
    return reply
