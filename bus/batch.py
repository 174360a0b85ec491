"""Several Lua script calls in one round trip.

A large share of a worker's CPU per job goes to round trips rather than to the commands in them:
measured alone, a redis-py round trip costs about 34 µs of client CPU, a command pipelined with
nine others about 9 µs (bench/RESULTS.md). Where a step makes independent script calls (the
planner claiming every ready task, then enqueueing each task's job), they go out here as one
non-transactional pipeline of `EVALSHA`s: each call is still its own atomic script, as when they
were sent one by one, and each gets its own reply or error.

redis-py's `Script` objects would do this too, but a pipeline holding them first asks the server
`SCRIPT EXISTS` (one more round trip every time). Here a script the server lost (a restart, a
`SCRIPT FLUSH`) is loaded and only the calls that did not run are sent again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from . import durability
from .scripts import Script


@dataclass(frozen=True)
class ScriptCall:
    """One call of a registered script: its keys and arguments. `guarded`: what the write is, when a
    failover must not lose it (`bus.durability`): with a replica policy, `WAIT` follows the calls in
    the same round trip, and `NotReplicated` is raised when too few replicas acknowledged it."""

    script: Script
    keys: Sequence[str]
    args: Sequence[str | int | float | bytes]
    guarded: str = ""


async def run_scripts(redis: Redis, calls: Sequence[ScriptCall], *, extra: Sequence[Sequence[Any]] = ()) -> list[Any]:
    """Run `calls` in one round trip; returns each call's reply, or the exception it raised.

    `extra`: plain commands (e.g. `("XADD", key, ...)`) sent after the calls in the same round trip;
    their replies are not returned, an error of theirs is raised."""
    replies, _ = await run_scripts_and_reads(redis, calls, (), extra=extra)
    return replies


async def run_scripts_and_reads(
    redis: Redis, calls: Sequence[ScriptCall], reads: Sequence[Sequence[Any]], *, extra: Sequence[Sequence[Any]] = ()
) -> tuple[list[Any], list[Any]]:
    """`run_scripts`, and the plain read commands `reads` (e.g. `("GET", key)`) in the same round
    trip, after the calls: returns the calls' replies and the reads' (an error reply returned, not
    raised). A read is not sent again when a script the server lost is loaded and re-run."""
    if not calls and not extra and not reads:
        return [], []
    policy = durability.policy_of(redis)
    wait = [("WAIT", policy.replicas, policy.timeout_ms)] if policy.replicas and any(c.guarded for c in calls) else []
    sent = await _send(redis, calls, [*reads, *extra, *wait])
    n = len(calls)
    read_replies = sent[n : n + len(reads)]
    replies = [*sent[:n], *sent[n + len(reads) :]]
    acked = replies[-1] if wait else None
    lost = [i for i, r in enumerate(replies[: len(calls)]) if isinstance(r, NoScriptError)]
    if lost:
        for script in {id(calls[i].script): calls[i].script for i in lost}.values():
            script.sha = await redis.script_load(script.script)
        again = await _send(redis, [calls[i] for i in lost], wait)
        for i, reply in zip(lost, again[: len(lost)], strict=True):
            replies[i] = reply
        if wait:
            acked = again[-1]  # this round trip carried the last guarded write
    for reply in replies[len(calls) :]:
        if isinstance(reply, BaseException):
            raise reply
    if wait and isinstance(acked, int) and acked < policy.replicas:
        what = ", ".join(sorted({c.guarded for c in calls if c.guarded}))
        raise durability.NotReplicated(what, acked, policy.replicas, policy.timeout)
    return replies[: len(calls)], read_replies


async def _send(redis: Redis, calls: Sequence[ScriptCall], extra: Sequence[Sequence[Any]]) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        for call in calls:
            pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
        for command in extra:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))
