"""Test your toolkits and goals in milliseconds: no Redis server, no worker processes, no network.

`run_goal` runs a goal through the real planner, executor and critic handlers in one event loop on
fakeredis, and returns everything the run wrote (`RunResult`: goal, events, plans, tasks, results,
steps, tool calls, ledger). The model is any `ModelPort`: a `ScriptedModel` whose replies the test
writes, the offline `DemoModel`, or a `ReplayModel` replaying a cassette recorded against Claude.

The pytest plugin (`taskloom.testing.plugin`, registered as a `pytest11` entry point) provides the
fixtures `taskloom_redis` and `taskloom_run`. Needs the `testing` extra:
`pip install 'taskloom[testing]'`.
"""

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
