"""pytest plugin: the `taskloom_redis` and `taskloom_run` fixtures.

Registered as a `pytest11` entry point named `taskloom.testing.plugin`, so an installed taskloom
provides the fixtures to every test suite. From a source tree that is not installed, load it with
`-p taskloom.testing.plugin` or `pytest_plugins = ["taskloom.testing.plugin"]` in the top-level
conftest (the entry point has the module's name, so loading it both ways registers it once).

Both fixtures are plain (synchronous) fixtures, usable from sync and async tests alike: a run makes
its Redis connections in the event loop that awaits it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from bus.schemas import Goal
from llm.port import ModelPort

from ..settings import Settings, load_settings
from .redis import TestRedis
from .run import DEFAULT_TIMEOUT, RunResult, Tools, run_goal

REDIS_URL_VARIABLE = "TASKLOOM_TEST_REDIS_URL"


class Runner:
    """`await taskloom_run(goal, tools=..., model=..., **settings)` in an async test,
    `taskloom_run.sync(goal, ...)` in a plain one. Keyword arguments other than tools, model,
    settings, timeout and check are `Settings` fields (`max_task_retries=0`, ...)."""

    def __init__(self, redis: TestRedis) -> None:
        self.redis = redis
        self.results: list[RunResult] = []

    def settings(self, base: Settings | None = None, **overrides: Any) -> Settings:
        """The settings of a run: `base` (default: from `TASKLOOM_*`, 0.05 s fallback poll) under this
        test's key prefix, with `overrides`."""
        base = base if base is not None else load_settings(poll_delay=0.05)
        return base.model_copy(update={**overrides, "key_prefix": self.redis.prefix})

    async def __call__(
        self,
        goal: Goal | Mapping[str, Any] | str,
        *,
        tools: Tools = None,
        model: ModelPort | None = None,
        settings: Settings | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = True,
        **overrides: Any,
    ) -> RunResult:
        run_settings = self.settings(settings, **overrides)
        async with self.redis.connect() as redis:
            result = await run_goal(
                goal, tools=tools, model=model, settings=run_settings, redis=redis, timeout=timeout, check=check
            )
        self.results.append(result)
        return result

    def sync(self, goal: Goal | Mapping[str, Any] | str, **kwargs: Any) -> RunResult:
        """The same run from a synchronous test (it runs its own event loop)."""
        return asyncio.run(self(goal, **kwargs))


@pytest.fixture
def taskloom_redis() -> Iterator[TestRedis]:
    """Where this test's runs keep their state: a fresh fakeredis server, or the real server at
    `TASKLOOM_TEST_REDIS_URL` under a key prefix of the test's own (deleted afterwards)."""
    handle = TestRedis(url=os.environ.get(REDIS_URL_VARIABLE) or None)
    try:
        yield handle
    finally:
        if not handle.fake:
            asyncio.run(handle.clear())


@pytest.fixture
def taskloom_run(taskloom_redis: TestRedis) -> Runner:
    """Run a goal in-process on `taskloom_redis` (see `Runner`)."""
    return Runner(taskloom_redis)
