"""Test your toolkits and goals in milliseconds: no Redis server, no worker processes, no network.

`run_goal` runs a goal through the real planner, executor and critic handlers in one event loop on
fakeredis, and returns everything the run wrote (`RunResult`: goal, events, plans, tasks, results,
steps, tool calls, ledger). The model is any `ModelPort`: a `ScriptedModel` whose replies the test
writes, the offline `DemoModel`, or a `ReplayModel` replaying a cassette recorded against Claude.

The pytest plugin (`taskloom.testing.plugin`, registered as a `pytest11` entry point) provides the
fixtures `taskloom_redis` and `taskloom_run`. Needs the `testing` extra:
`pip install 'taskloom[testing]'`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llm.cassette import CassetteError, CassetteMiss, RecordingModel, request_digest
    from llm.demo import DemoModel

    from .redis import TestingSetupError, TestRedis, fake_redis
    from .replay import ReplayModel
    from .run import (
        FailedJob,
        InProcessFleet,
        RunError,
        RunResult,
        RunTimeout,
        ToolCall,
        collect,
        run_goal,
    )
    from .scripted import (
        ScriptedCall,
        ScriptedModel,
        UnscriptedRequest,
        accept,
        attempt_of,
        http_responder,
        plan,
        replan,
        retry,
        role_of,
        task,
        task_of,
        text,
        tool_call,
        tool_calls,
        tool_results,
        verdict,
    )

# Imported on first use: `taskloom.testing.run` alone (as `taskloom eval` uses it) must not pay for
# the fake servers and the provider SDKs that `scripted` brings in.
_HOMES: dict[str, str] = {
    "CassetteError": "llm.cassette",
    "CassetteMiss": "llm.cassette",
    "RecordingModel": "llm.cassette",
    "request_digest": "llm.cassette",
    "DemoModel": "llm.demo",
    "TestingSetupError": "taskloom.testing.redis",
    "TestRedis": "taskloom.testing.redis",
    "fake_redis": "taskloom.testing.redis",
    "ReplayModel": "taskloom.testing.replay",
    "FailedJob": "taskloom.testing.run",
    "InProcessFleet": "taskloom.testing.run",
    "RunError": "taskloom.testing.run",
    "RunResult": "taskloom.testing.run",
    "RunTimeout": "taskloom.testing.run",
    "ToolCall": "taskloom.testing.run",
    "collect": "taskloom.testing.run",
    "run_goal": "taskloom.testing.run",
    "ScriptedCall": "taskloom.testing.scripted",
    "ScriptedModel": "taskloom.testing.scripted",
    "UnscriptedRequest": "taskloom.testing.scripted",
    "accept": "taskloom.testing.scripted",
    "attempt_of": "taskloom.testing.scripted",
    "http_responder": "taskloom.testing.scripted",
    "plan": "taskloom.testing.scripted",
    "replan": "taskloom.testing.scripted",
    "retry": "taskloom.testing.scripted",
    "role_of": "taskloom.testing.scripted",
    "task": "taskloom.testing.scripted",
    "task_of": "taskloom.testing.scripted",
    "text": "taskloom.testing.scripted",
    "tool_call": "taskloom.testing.scripted",
    "tool_calls": "taskloom.testing.scripted",
    "tool_results": "taskloom.testing.scripted",
    "verdict": "taskloom.testing.scripted",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'taskloom.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = [
    "CassetteError",
    "CassetteMiss",
    "DemoModel",
    "FailedJob",
    "InProcessFleet",
    "RecordingModel",
    "ReplayModel",
    "RunError",
    "RunResult",
    "RunTimeout",
    "ScriptedCall",
    "ScriptedModel",
    "TestRedis",
    "TestingSetupError",
    "ToolCall",
    "UnscriptedRequest",
    "accept",
    "attempt_of",
    "collect",
    "fake_redis",
    "http_responder",
    "plan",
    "replan",
    "request_digest",
    "retry",
    "role_of",
    "run_goal",
    "task",
    "task_of",
    "text",
    "tool_call",
    "tool_calls",
    "tool_results",
    "verdict",
]
