"""Several Lua script calls in one round trip.

A large share of a worker's CPU per job goes to round trips rather than to the commands in them:
measured alone, a redis-py round trip costs about 34 µs of client CPU, a command pipelined with
nine others about 9 µs (bench/RESULTS.md). Where a step makes independent script calls (the
planner claiming every ready task, then enqueueing each task's job), they go out here as one
non-transactional pipeline of `EVALSHA`s: each call is still its own atomic script, as when they
were sent one by one, and each gets its own reply or error. A script of a library of Redis
Functions (`bus.scripts.library`: the ledger's, such as the held settles an attempt's write
carries) goes as its `FCALL` where the server has Functions, as it does on its own.

redis-py's `Script` objects would do this too, but a pipeline holding them first asks the server
`SCRIPT EXISTS` (one more round trip every time). Here a script the server lost (a restart, a
`SCRIPT FLUSH`, a `FUNCTION FLUSH`) is loaded and only the calls that did not run are sent again;
so are the calls of a library the server cannot run as Functions (Redis 6, an ACL forbidding
them), by `EVALSHA` from then on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

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
    as_function = [call.script.function is not None for call in calls]
    sent = await _send(redis, calls, [*reads, *extra, *wait])
    n = len(calls)
    read_replies = sent[n : n + len(reads)]
    replies = [*sent[:n], *sent[n + len(reads) :]]
    acked = replies[-1] if wait else None
    # Calls that did not run because the server lacked their script or function, now mended (loaded,
    # once per script; or the script set to run by EVALSHA), to be sent again. A script's own error
    # is its reply.
    lost, loaded = [], set()
    for i, reply in enumerate(replies[:n]):
        script = calls[i].script
        if isinstance(reply, NoScriptError):
            if id(script) not in loaded:
                script.sha = await redis.script_load(script.script)
                loaded.add(id(script))
            lost.append(i)
        elif as_function[i] and isinstance(reply, ResponseError) and await script.function_missing(reply):
            if script.function is None and id(script) not in loaded:  # by EVALSHA from now on: loaded first
                script.sha = await redis.script_load(script.script)
                loaded.add(id(script))
            lost.append(i)
    if lost:
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
            function = call.script.function
            if function is not None:
                pipe.execute_command("FCALL", function.name, len(call.keys), *call.keys, *call.args)
            else:
                pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
        for command in extra:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))
