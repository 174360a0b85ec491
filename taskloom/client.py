"""`taskloom.Client`: the bus client, opened on the same settings as the `taskloom` command.

`bus.client.Client` takes its Redis and keys as arguments (`bus` knows nothing of settings);
`Client.from_settings()` reads the `TASKLOOM_*` variables, so a Python application reaches the same
Redis (the same embedded server under `TASKLOOM_HOME`), key prefix and queues as the CLI and the
workers, instead of a second server that no worker uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from bus import client as bus_client
from bus.connection import connect

from .settings import Settings, keys_for, load_settings


class Client(bus_client.Client):
    @classmethod
    @contextlib.asynccontextmanager
    async def from_settings(cls, settings: Settings | None = None) -> AsyncIterator[Client]:
        """A client on the configured Redis: `TASKLOOM_REDIS_URL`, or the embedded server under
        `TASKLOOM_HOME` (started if needed, stopped on exit if no other taskloom process uses it).

        Raises `taskloom.settings.SettingsError` naming the variable when a setting is invalid.
        """
        s = settings or load_settings()
        async with connect(s.redis_url, s.home, share=s.redis_shared_connection) as redis:
            yield cls(redis, keys_for(s), s.default_budget_tokens, s.events_maxlen)
