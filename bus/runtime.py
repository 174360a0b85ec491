"""What a job handler gets to work with: the shared Redis-backed services, built once per worker."""

from __future__ import annotations

from dataclasses import dataclass

from arq.connections import ArqRedis

from .events import EventLog
from .jobs import Jobs
from .keys import Keys
from .store import Store


@dataclass(frozen=True)
class Runtime:
    redis: ArqRedis
    keys: Keys
    store: Store
    events: EventLog
    jobs: Jobs

    @classmethod
    def build(cls, redis: ArqRedis, keys: Keys, events_maxlen: int = 10_000) -> Runtime:
        return cls(
            redis=redis,
            keys=keys,
            store=Store(redis, keys, events_maxlen),
            events=EventLog(redis, keys, events_maxlen),
            jobs=Jobs(redis, keys),
        )
