"""Retention: every key of a goal that ended longer ago than `TASKLOOM_RETENTION` is deleted, so a
long-running fleet does not fill Redis with its history.

A goal's keys are all named from its id (`bus.keys`): the goal hash and the fixed per-goal keys
(events, results, syntheses, drivers, ledger books, approvals), one key per plan version
(`plan_version` of the goal hash), and per task (the goal's task-id set) its hash, its side-effect
record and each attempt's lease, steps and pending step (`attempt` of the task hash). They are
listed from those fields, not by scanning the keyspace, and deleted in one transaction that
`WATCH`es the goal hash: a goal resumed meanwhile is left alone. Candidates come from the goal index
(by submission time): a goal that ended more than the retention ago was submitted before that.

Not per goal, and so not deleted here: the ledger's tenant pools (one per tenant and period), the
global event stream (capped), the approvals inbox (it drops entries of ended goals itself), arq's
job and result keys (they expire on their own).
"""

from __future__ import annotations

from datetime import datetime

from redis.asyncio import Redis
from redis.exceptions import WatchError

from .keys import Keys
from .ledger import Ledger
from .replies import as_str
from .schemas import GOAL_TERMINAL, GoalState

BATCH = 200  # goals read per round trip while looking for ended ones


def expired(state: str | None, updated_at: str | None, cutoff: float) -> bool:
    """A goal in a final state whose last change is older than `cutoff` (epoch seconds)."""
    if state is None or updated_at is None:
        return False
    try:
        final = GoalState(state) in GOAL_TERMINAL
        changed = datetime.fromisoformat(updated_at).timestamp()
    except ValueError:
        return False  # a damaged record is left for a person to look at
    return final and changed < cutoff


async def goal_keys(redis: Redis, keys: Keys, goal_id: str) -> list[str]:
    """Every key the goal may have (some may not exist)."""
    plan_version = await redis.hget(keys.goal(goal_id), "plan_version")  # type: ignore[misc]
    task_ids = sorted(as_str(t) for t in await redis.smembers(keys.task_ids(goal_id)))  # type: ignore[misc]
    async with redis.pipeline(transaction=False) as pipe:
        for tid in task_ids:
            pipe.hget(keys.task(goal_id, tid), "attempt")
        attempts = await pipe.execute()
    out = [
        keys.goal(goal_id),
        keys.task_ids(goal_id),
        keys.results(goal_id),
        keys.syntheses(goal_id),
        keys.goal_events(goal_id),
        keys.drivers(goal_id),
        keys.provider_trouble(goal_id),
        keys.ledger(goal_id),
        keys.approvals(goal_id),
        keys.approval_requests(goal_id),
    ]
    out += [keys.plan(goal_id, v) for v in range(1, int(as_str(plan_version or 0)) + 1)]
    for tid, attempt in zip(task_ids, attempts, strict=True):
        out += [keys.task(goal_id, tid), keys.side_effects(goal_id, tid)]
        for n in range(1, int(as_str(attempt or 0)) + 1):
            out += [keys.attempt_lease(goal_id, tid, n), keys.attempt_steps(goal_id, tid, n)]
            out.append(keys.attempt_pending(goal_id, tid, n))
    return out


async def delete_all(redis: Redis, keys: Keys) -> int:
    """Delete every key under `keys.prefix`, arq's keys of its jobs included (on a server shared with
    others: never FLUSHDB). Returns how many were deleted."""
    n = 0
    for pattern in keys.patterns():
        batch = [k async for k in redis.scan_iter(match=pattern, count=1000)]
        for start in range(0, len(batch), 500):
            n += await redis.delete(*batch[start : start + 500])
    return n


async def purge_goal(redis: Redis, keys: Keys, goal_id: str, cutoff: float) -> bool:
    """Delete the goal's keys if it ended before `cutoff`; False if it did not (or changed meanwhile)."""
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(keys.goal(goal_id))
            state, updated = await pipe.hmget(keys.goal(goal_id), ["state", "updated_at"])  # type: ignore[misc]
            state_s = None if state is None else as_str(state)
            if not expired(state_s, None if updated is None else as_str(updated), cutoff):
                return False
            doomed = await goal_keys(redis, keys, goal_id)
            pipe.multi()  # type: ignore[no-untyped-call]
            # A tenant's goal may still hold a grant of its pool: it ends before its books go.
            Ledger.end_grant_in(pipe, keys, goal_id)
            pipe.unlink(*doomed)
            for index in (keys.goal_index(), keys.active_index(), keys.submitted_index()):
                pipe.zrem(index, goal_id)
            await pipe.execute()
        except WatchError:
            return False
    return True


async def purge_ended(redis: Redis, keys: Keys, retention: float, now: float) -> int:
    """Delete every goal that ended more than `retention` seconds before `now`; returns how many."""
    cutoff = now - retention
    purged = offset = 0
    while True:
        ids = await redis.zrangebyscore(keys.goal_index(), "-inf", cutoff, start=offset, num=BATCH)
        if not ids:
            return purged
        done = 0
        for raw in ids:
            if await purge_goal(redis, keys, as_str(raw), cutoff):
                done += 1
        purged += done
        offset += len(ids) - done  # the purged ones left the index
