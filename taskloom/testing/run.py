"""Run goals in this process: the production workers (`taskloom.workers.build_workers`) on one Redis,
usually fakeredis, until nothing is left to do; then everything the run wrote, ready to assert on.

Nothing here stands in for production code: jobs are enqueued by the roles through `bus.jobs`,
picked up by arq workers (taskloom's `WakeableWorker`, in this event loop), validated and logged by
the same job wrapper, and handled by the same planner, executor and critic handlers, on the same
Lua scripts, ledger and metered model. What differs from `taskloom worker all` is what a single test
needs no part of: no signal handlers, heartbeats, metrics, reconciler or lease watchdog.

A run is over when it has *settled*: no job is queued or running for a while (two checks apart).
Then the goal has ended, or it waits for something outside the system (a tool call awaiting
approval), or a job failed and nothing will move it again, which `run_goal` reports as an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from arq.connections import ArqRedis
from arq.constants import result_key_prefix
from arq.jobs import Job
from arq.worker import Worker

from bus.attempts import AttemptStore, StepRecord
from bus.client import Client
from bus.keys import ROLES, Keys
from bus.ledger import Ledger, LedgerNotFound, LedgerSnapshot
from bus.replies import as_str
from bus.runtime import Runtime
from bus.schemas import Event, Goal, GoalRecord, GoalState, StoredPlan, TaskRecord, TaskResult
from executor.demo_tools import support
from executor.registry import ToolRegistry, load_toolkits
from executor.toolkit import Toolkit
from llm.demo import DemoModel
from llm.port import ModelPort
from llm.types import ToolUseBlock

from ..settings import Settings, load_settings
from ..workers import _shutdown, build_workers
from .redis import fake_redis, unique_prefix

SETTLE_CHECK = 0.005  # seconds between two looks at the queues
DEFAULT_TIMEOUT = 60.0
SHUTDOWN_GRACE = 0.5  # seconds running jobs get when a fleet stops

Tools = Toolkit | ToolRegistry | Iterable[Toolkit] | None


class RunError(AssertionError):
    """A test run went wrong in a way the test should hear about (an AssertionError, so pytest shows
    it as a failure): a job failed, the model's script had no reply, or the run did not settle."""


class RunTimeout(RunError):
    """The run was still busy when its timeout ran out."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call the executor made: what the model asked and what it got back."""

    task_id: str
    attempt: int
    step: int
    id: str
    name: str
    input: dict[str, Any] | None  # None if the call's turn was not stored (its attempt stopped first)
    outcome: str  # ok, error, timeout, invalid_args, unknown_tool, denied, cancelled, ...
    output: str | None  # the full, untruncated output (None if not stored)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


@dataclass(frozen=True)
class FailedJob:
    job_id: str
    function: str
    error: BaseException | None


@dataclass(frozen=True)
class RunResult:
    """Everything a run left in Redis, read back once it settled."""

    goal: GoalRecord
    events: list[Event]
    plans: list[StoredPlan]
    tasks: dict[str, TaskRecord]
    results: list[TaskResult]  # one per finished attempt, by task then attempt
    steps: dict[tuple[str, int], list[StepRecord]]  # (task id, attempt) -> the stored steps
    tool_calls: list[ToolCall]  # in the order they finished
    ledger: LedgerSnapshot | None
    failed_jobs: list[FailedJob] = field(default_factory=list)
    seconds: float = 0.0

    # The goal record's fields, read through: `result.state` as `result.goal.state`.
    @property
    def goal_id(self) -> str:
        return self.goal.id

    @property
    def id(self) -> str:
        return self.goal.id

    @property
    def state(self) -> GoalState:
        return self.goal.state

    @property
    def answer(self) -> str | None:
        return self.goal.answer

    @property
    def reason(self) -> str | None:
        return self.goal.reason

    @property
    def plan_version(self) -> int:
        return self.goal.plan_version

    @property
    def terminal(self) -> bool:
        return self.goal.terminal

    @property
    def plan(self) -> StoredPlan | None:
        """The current plan (the last version)."""
        return self.plans[-1] if self.plans else None

    @property
    def event_types(self) -> list[str]:
        return [e.type for e in self.events]

    def calls(self, tool: str | None = None, task_id: str | None = None) -> list[ToolCall]:
        """Tool calls, of one tool and/or one task."""
        return [
            c for c in self.tool_calls if (tool is None or c.name == tool) and (task_id is None or c.task_id == task_id)
        ]

    def result(self, task_id: str) -> TaskResult | None:
        """The latest attempt's result of `task_id`."""
        found = [r for r in self.results if r.task_id == task_id]
        return found[-1] if found else None

    def summary(self) -> str:
        """One line per task, for assertion messages."""
        lines = [
            f"goal {self.goal.id}: {self.goal.state.value} (plan v{self.goal.plan_version}) {self.goal.reason or ''}"
        ]
        for tid, rec in self.tasks.items():
            lines.append(f"  {tid}: {rec.state.value} attempt {rec.attempt} {rec.reason or ''}".rstrip())
        for job in self.failed_jobs:
            first = str(job.error).splitlines()[0][:200] if job.error is not None else "no result"
            lines.append(f"  failed job {job.job_id}: {type(job.error).__name__}: {first}")
        return "\n".join(lines)


def as_registry(tools: Tools, settings: Settings, model: ModelPort) -> ToolRegistry:
    """The tools of a run. None: the Python toolkits a worker would load (`TASKLOOM_TOOLS`, or the
    demo toolkit when the model is the demo model); MCP servers are not started in-process."""
    if tools is None:
        return ToolRegistry(load_toolkits(settings.tools, default=[support] if model.model == "demo" else []))
    if isinstance(tools, ToolRegistry):
        return tools
    if isinstance(tools, Toolkit):
        return ToolRegistry([tools])
    return ToolRegistry(list(tools))


async def _failed_jobs(redis: ArqRedis, keys: Keys, goal_id: str) -> list[FailedJob]:
    failed = []
    async for raw in redis.scan_iter(match=f"{result_key_prefix}{keys.job_id('*')}", count=1000):
        job_id = as_str(raw).removeprefix(result_key_prefix)
        if f":{goal_id}" not in job_id:
            continue
        info = await Job(job_id, redis).result_info()
        if info is not None and not info.success:
            error = info.result if isinstance(info.result, BaseException) else None
            failed.append(FailedJob(job_id, info.function, error))
    return failed


async def collect(redis: ArqRedis, keys: Keys, goal_id: str, seconds: float = 0.0) -> RunResult:
    """Read everything about `goal_id` back from Redis (whoever ran it: this process or real workers)."""
    client = Client(redis, keys, default_budget_tokens=1)
    goal = await client.get(goal_id)
    events = await client.log.read(goal_id, count=100_000)
    plans = [await client.store.get_plan(goal_id, v) for v in range(1, goal.plan_version + 1)]
    tasks = await client.store.get_tasks(goal_id)
    results: list[TaskResult] = []
    steps: dict[tuple[str, int], list[StepRecord]] = {}
    pending: dict[tuple[str, int], Any] = {}
    for tid, record in tasks.items():
        for attempt in range(1, record.attempt + 1):
            result = await client.store.get_result(goal_id, tid, attempt)
            if result is not None:
                results.append(result)
            store = AttemptStore(redis, keys, goal_id, tid, attempt)
            stored = await store.steps()
            if stored:
                steps[(tid, attempt)] = stored
            pending[(tid, attempt)] = await store.pending()
    calls = []
    for event in events:
        if event.type != "tool.call" or event.task_id is None:
            continue
        d = event.data
        attempt, step, call_id = int(d.get("attempt", 0)), int(d.get("step", 0)), str(d.get("call_id"))
        args: dict[str, Any] | None = None
        output: str | None = None
        turns = [s.assistant for s in steps.get((event.task_id, attempt), [])]
        waiting = pending.get((event.task_id, attempt))
        if waiting is not None and waiting.turn is not None:
            turns.append(waiting.turn.as_message())
        for message in turns:
            for block in message.content:
                if isinstance(block, ToolUseBlock) and block.id == call_id:
                    args = dict(block.input)
        outcomes = [o for s in steps.get((event.task_id, attempt), []) for o in s.outcomes]
        if waiting is not None:
            outcomes += list(waiting.results.values())
        output = next((o.full for o in outcomes if o.call_id == call_id), None)
        calls.append(
            ToolCall(event.task_id, attempt, step, call_id, str(d.get("tool")), args, str(d.get("outcome")), output)
        )
    try:
        books: LedgerSnapshot | None = await Ledger(redis, keys).snapshot(goal_id)
    except LedgerNotFound:
        books = None
    results.sort(key=lambda r: (r.task_id, r.attempt))
    return RunResult(
        goal=goal,
        events=events,
        plans=plans,
        tasks=tasks,
        results=results,
        steps=steps,
        tool_calls=calls,
        ledger=books,
        failed_jobs=await _failed_jobs(redis, keys, goal_id),
        seconds=seconds,
    )


class InProcessFleet:
    """The three roles' workers running in this event loop on `redis`.

    >>> async with InProcessFleet(model=ScriptedModel(...), tools=kit) as fleet:
    ...     goal_id = await fleet.submit("Refund order A100")
    ...     result = await fleet.settle(goal_id)

    Use it directly for what `run_goal` cannot express: acting on a goal while it runs (cancel it,
    approve a tool call, submit several goals).
    """

    def __init__(
        self,
        *,
        tools: Tools = None,
        model: ModelPort | None = None,
        settings: Settings | None = None,
        redis: ArqRedis | None = None,
    ) -> None:
        self.model: ModelPort = model if model is not None else DemoModel(latency=0)
        if settings is None:
            # Fallback polls only: wake-ups start every job at once, in process as across processes.
            # On a Redis of yours, a key prefix of its own: a test never touches anything else there.
            overrides: dict[str, Any] = {"poll_delay": 0.05}
            if redis is not None:
                overrides["key_prefix"] = unique_prefix()
            settings = load_settings(**overrides)
        self.settings = settings
        self.registry = as_registry(tools, self.settings, self.model)
        self._given_redis = redis
        self.redis: ArqRedis | None = None
        self.runtime: Runtime | None = None
        self.client: Client | None = None
        self.workers: list[Worker] = []
        self._mains: list[asyncio.Task[None]] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> InProcessFleet:
        redis = self._given_redis
        if redis is None:
            redis = fake_redis()
            self._stack.push_async_callback(redis.aclose, close_connection_pool=True)
        self.redis = redis
        self.runtime, self.workers = build_workers(list(ROLES), self.settings, redis, self.model, self.registry)
        self.client = Client(redis, self.runtime.keys, self.settings.default_budget_tokens, self.settings.events_maxlen)
        self._mains = [
            asyncio.create_task(w.main(), name=f"taskloom-testing-{r}")
            for w, r in zip(self.workers, ROLES, strict=True)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            # Jobs still running here belong to a run that failed or timed out: do not wait long for them.
            await _shutdown(self.workers, self._mains, [], SHUTDOWN_GRACE)
            if self.runtime is not None and self.redis is not None:
                await self.redis.delete(*(self.runtime.keys.health_check(r) for r in ROLES))
        finally:
            await self._stack.aclose()

    def _ready(self) -> tuple[ArqRedis, Keys, Client]:
        if self.redis is None or self.runtime is None or self.client is None:
            raise RuntimeError("use the fleet inside `async with InProcessFleet(...) as fleet:`")
        return self.redis, self.runtime.keys, self.client

    async def submit(self, goal: Goal | Mapping[str, Any] | str, goal_id: str | None = None) -> str:
        """Submit a goal as an application does (`Client.submit`); returns its id."""
        return await self._ready()[2].submit(goal, goal_id)

    async def idle(self) -> bool:
        """True when no job is queued or running (a job stays in its queue until it has finished)."""
        redis, keys, _ = self._ready()
        if any(not t.done() for w in self.workers for t in w.tasks.values()):
            return False  # known without asking Redis
        for role in ROLES:
            if await redis.zcard(keys.queue(role)):
                return False
        return True

    async def settle(self, goal_id: str, timeout: float = DEFAULT_TIMEOUT, *, check: bool = True) -> RunResult:
        """Wait until nothing is left to do, then read the run back.

        With `check`, raise `RunError` when a job failed or the model's script had no reply, and
        `RunTimeout` when the run is still busy after `timeout` seconds."""
        redis, keys, client = self._ready()
        started = time.monotonic()
        deadline = started + timeout
        quiet = 0
        while quiet < 2:
            if time.monotonic() > deadline:
                goal = await client.get(goal_id)
                raise RunTimeout(f"goal {goal_id} still {goal.state.value} and busy after {timeout:g} s")
            quiet = quiet + 1 if await self.idle() else 0
            await asyncio.sleep(SETTLE_CHECK)
        result = await collect(redis, keys, goal_id, time.monotonic() - started)
        if check:
            _check(result, self.model)
        return result

    async def run(
        self, goal: Goal | Mapping[str, Any] | str, timeout: float = DEFAULT_TIMEOUT, *, check: bool = True
    ) -> RunResult:
        started = time.monotonic()
        goal_id = await self.submit(goal)
        result = await self.settle(goal_id, timeout, check=check)
        return _with_seconds(result, time.monotonic() - started)


def _with_seconds(result: RunResult, seconds: float) -> RunResult:
    return replace(result, seconds=seconds)


def _check(result: RunResult, model: ModelPort) -> None:
    problems: Sequence[str] = getattr(model, "problems", ())
    if problems:
        listed = "\n".join(f"- {p}" for p in problems)
        raise RunError(f"the model could not answer every request:\n{listed}\n{result.summary()}")
    if result.failed_jobs:
        first = result.failed_jobs[0]
        raise RunError(f"{len(result.failed_jobs)} job(s) failed:\n{result.summary()}") from first.error


async def run_goal(
    goal: Goal | Mapping[str, Any] | str,
    *,
    tools: Tools = None,
    model: ModelPort | None = None,
    settings: Settings | None = None,
    redis: ArqRedis | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    check: bool = True,
) -> RunResult:
    """Run one goal to the end in this process and return what it left behind.

    `goal`: a `Goal`, its fields as a dict, or the goal text. `tools`: a `Toolkit`, several, or a
    `ToolRegistry` (None: what a worker would load). `model`: any `ModelPort`; default the offline
    `DemoModel` without its simulated latency. `settings`: `Settings` (default: from `TASKLOOM_*`,
    with a 0.05 s fallback poll). `redis`: an arq client (default: a fresh fakeredis server; given
    one without settings, the run uses a key prefix of its own).

    Raises `RunError` (an AssertionError) when a job failed or the model had no reply for a request,
    `RunTimeout` when the run is still busy after `timeout` seconds; `check=False` returns the
    result anyway.
    """
    async with InProcessFleet(tools=tools, model=model, settings=settings, redis=redis) as fleet:
        return await fleet.run(goal, timeout, check=check)
