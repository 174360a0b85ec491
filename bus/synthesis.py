"""The goal's final answer and verdict, written for one exact set of task attempts.

The critic writes the final answer and its verdict in one model call (`FinalVerdict`), and may do so
speculatively: as soon as every task of the plan has a result under review, before the reviews
end. What it wrote is stored under the plan version and the attempts it was written from (the
attempts key); it is used only when every task of that plan is accepted with exactly those
attempts. A rejected review moves its task to a new attempt, so a speculation written from the
rejected result never matches again: it is dropped by construction, never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

from redis.asyncio import Redis

from .keys import Keys
from .schemas import FinalVerdict, Plan, TaskState

# Task states whose current attempt has a result that is, or may yet be, accepted.
REVIEWED_OR_DONE = frozenset({TaskState.REVIEWING, TaskState.DONE})


class Progress(Protocol):
    """What the keys below read of a task: a whole `TaskRecord`, or only its `TaskProgress`."""

    @property
    def state(self) -> TaskState: ...

    @property
    def attempt(self) -> int: ...


def attempts_key(plan: Plan, records: Mapping[str, Progress], states: frozenset[TaskState]) -> str | None:
    """A short digest of `task:attempt` for every task of `plan`, when each task is in one of
    `states` (else None): the identity of the results a final answer is written from."""
    pairs = []
    for spec in plan.tasks:
        rec = records.get(spec.id)
        if rec is None or rec.state not in states or rec.attempt < 1:
            return None
        pairs.append(f"{spec.id}:{rec.attempt}")
    return hashlib.sha256(",".join(pairs).encode()).hexdigest()[:16]


def speculation_key(plan: Plan, records: Mapping[str, Progress]) -> str | None:
    """The attempts key when every task has a result in review or accepted (synthesis may start)."""
    return attempts_key(plan, records, REVIEWED_OR_DONE)


def accepted_key(plan: Plan, records: Mapping[str, Progress]) -> str | None:
    """The attempts key when every task is accepted (a synthesis for it may conclude the goal)."""
    return attempts_key(plan, records, frozenset({TaskState.DONE}))


class Syntheses:
    """Final answers written per (plan version, attempts key); the first write wins (HSETNX)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def save(self, goal_id: str, version: int, key: str, final: FinalVerdict) -> bool:
        """Store the final answer; False when one was already stored for this key (it stands)."""
        field = f"{version}:{key}"
        return bool(await self.redis.hsetnx(self.keys.syntheses(goal_id), field, final.model_dump_json()))  # type: ignore[misc]

    async def get(self, goal_id: str, version: int, key: str) -> FinalVerdict | None:
        raw = await self.redis.hget(self.keys.syntheses(goal_id), f"{version}:{key}")  # type: ignore[misc]
        return None if raw is None else FinalVerdict.model_validate_json(raw)
