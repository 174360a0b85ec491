"""Run a suite's cases on a fleet, once per model and repeat, and turn each finished goal into a
`RunRecord`: what the checks found, and its tokens, cost, latency, steps, critic retries and replans.

Every case is submitted as a goal through the public client and read back, once it has ended, with
the testing kit's `collect` (goal record, events, tool calls with their arguments, ledger), so a
local run and a remote fleet are judged from exactly the same records.

- Remote (the fleet `TASKLOOM_REDIS_URL` names): goals are submitted with `Goal.model` set to the
  alias being evaluated; the fleet's models file must define it.
- Local: the production workers (`taskloom.workers.run_workers`, as `taskloom run --local`) run in
  this process, one fleet per model, with the model as `TASKLOOM_MODEL` and no per-role models.
  Each fleet gets a key prefix of its own (so workers elsewhere on the same Redis never take its
  jobs), deleted when the fleet stops: the results file is what remains.
- A model given as a `ModelPort` (a cassette replay, a scripted model in tests) replaces the
  configured ones in its local fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from bus.client import Client
from bus.connection import RedisPool, connect
from bus.keys import ROLES, Keys
from bus.retention import delete_all
from bus.schemas import GoalRecord
from llm.cassette import CassetteMiss
from llm.port import ModelPort, TextSink
from llm.types import ModelRequest, ModelResponse

from .. import health
from ..runner import preflight
from ..settings import Settings, keys_for
from ..testing.run import RunResult, collect
from ..workers import close_models, make_ledger, make_models, run_workers
from .checks import Called, Observed, problems
from .judge import Judge, Judgement, books_of
from .results import RunRecord
from .suite import Case

POLL = 0.05  # seconds between two looks at a running goal's state
ANSWER_KEPT = 4_000  # characters of each answer kept in the results file


@dataclass(frozen=True)
class Target:
    """One model the suite runs on. `name`: how reports call it, and the alias goals (remote) or the
    local fleet's settings use; None: the fleet's own configuration. `port`: a model object that
    replaces the configured ones (local only)."""

    name: str | None
    port: ModelPort | None = None
    replay: bool = False  # the port replays a cassette: the judge's calls replay from it too

    def label(self, settings: Settings, local: bool) -> str:
        if self.name is not None:
            return self.name
        return settings.model if local else "fleet"


class NoFleet(ValueError):
    """A remote eval found no live worker for some role: its goals would only wait out their timeouts."""


class MissLog:
    """A `ModelPort` around another that notes, per goal, the first request a cassette could not
    answer (its diff), so that run is reported as needing re-recording, not as an agent failure."""

    def __init__(self, inner: ModelPort) -> None:
        self.inner = inner
        self.name, self.model = inner.name, inner.model
        self.misses: dict[str, str] = {}

    async def complete(self, request: ModelRequest, on_text: TextSink | None = None) -> ModelResponse:
        try:
            return await (self.inner.complete(request) if on_text is None else self.inner.complete(request, on_text))
        except CassetteMiss as exc:
            self.misses.setdefault(str(request.metadata.get("goal_id", "")), str(exc))
            raise

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()


@dataclass
class Job:
    case: Case
    repeat: int
    model: str  # the label in reports
    alias: str | None  # Goal.model (remote), None locally: the fleet's settings choose


@dataclass
class Fleet:
    client: Client
    misses: MissLog | None = None
    alive: Callable[[], None] = lambda: None  # raises when the local workers stopped
    labels: dict[str, str] = field(default_factory=dict)
    judge: Judge | None = None  # scores the cases' rubrics


def observe(result: RunResult, seconds: float) -> Observed:
    books = result.ledger
    return Observed(
        state=result.state,
        answer=result.answer,
        reason=result.reason,
        calls=tuple(Called(c.name, c.input) for c in result.tool_calls),
        cost_usd=books.cost_usd if books else 0.0,
        seconds=seconds,
        steps=books.calls if books else 0,
    )


def latency(goal: GoalRecord, wall: float) -> float:
    """Seconds from submit to the goal's end, by the goal record's own clock (the fleet's)."""
    if goal.terminal:
        return max(0.0, (goal.updated_at - goal.created_at).total_seconds())
    return wall


def record_of(
    job: Job, result: RunResult, seconds: float, miss: str | None = None, judged: Judgement | None = None
) -> RunRecord:
    """The run's record: its checks' and the judge's verdicts, and its numbers."""
    seen = observe(result, seconds)
    found = problems(job.case.expect, seen) if miss is None else []
    if judged is not None and not judged.passed and miss is None:
        found.append(f"rubric failed: {judged.feedback}")
    retries = sum(1 for e in result.events if e.type == "critic.verdict" and e.data.get("action") == "retry")
    status = "rerecord" if miss is not None else ("failed" if found else "passed")
    return RunRecord(
        case=job.case.id,
        model=job.model,
        repeat=job.repeat,
        goal_id=result.goal_id,
        status=status,
        problems=["needs re-recording: a request is not in the cassette"] if miss is not None else found,
        state=result.state.value,
        answer=(result.answer or "")[:ANSWER_KEPT] or None,
        tokens=result.ledger.spent if result.ledger else 0,
        cost_usd=seen.cost_usd,
        seconds=seconds,
        steps=seen.steps,
        tool_calls=len(result.tool_calls),
        retries=retries,
        replans=result.goal.replans,
        diff=miss,
        rubric_passed=judged.passed if judged else None,
        rubric_feedback=judged.feedback if judged else None,
        judge_tokens=judged.tokens if judged else 0,
        judge_cost_usd=judged.cost_usd if judged else 0.0,
    )


async def run_one(fleet: Fleet, job: Job) -> RunRecord:
    client = fleet.client
    labels = {**fleet.labels, "eval_case": job.case.id, "eval_repeat": str(job.repeat)}
    goal_id = await client.submit(job.case.to_goal(job.alias, labels))
    started = time.monotonic()
    timeout = job.case.timeout or 60.0
    goal = await client.get(goal_id)
    while not goal.terminal and time.monotonic() - started < timeout:
        fleet.alive()
        await asyncio.sleep(POLL)
        goal = await client.get(goal_id)
    wall = time.monotonic() - started
    if not goal.terminal:
        await client.cancel(goal_id, f"taskloom eval: still {goal.state.value} after {timeout:g} s")
        return RunRecord(
            case=job.case.id,
            model=job.model,
            repeat=job.repeat,
            goal_id=goal_id,
            status="error",
            problems=[f"timeout: the goal was still {goal.state.value} after {timeout:g} s (cancelled)"],
            state=goal.state.value,
            seconds=wall,
        )
    result = await collect(client.redis, client.keys, goal_id, wall)
    misses = fleet.misses.misses if fleet.misses is not None else {}
    judged = None
    if job.case.rubric and fleet.judge is not None and goal_id not in misses:
        judged = await fleet.judge.score(goal_id, job.case.goal, job.case.rubric, result.answer or "")
    miss = misses.get(goal_id) or misses.get(books_of(goal_id))
    return record_of(job, result, latency(goal, wall), miss, judged)


async def _run_jobs(
    fleet: Fleet, jobs: Sequence[Job], concurrency: int, on_run: Callable[[RunRecord], None] | None
) -> list[RunRecord]:
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> RunRecord:
        async with gate:
            record = await run_one(fleet, job)
        if on_run is not None:
            on_run(record)
        return record

    return list(await asyncio.gather(*(one(j) for j in jobs)))


def jobs_for(cases: Sequence[Case], model: str, alias: str | None, repeat: int) -> list[Job]:
    return [Job(case, n, model, alias) for n in range(1, repeat + 1) for case in cases]


async def _forget(redis: RedisPool, prefix: str) -> None:
    """Delete a local eval fleet's keys, and arq's job and result keys (their ids start with the prefix)."""
    await delete_all(redis, Keys(prefix=prefix))


@contextlib.asynccontextmanager
async def judging(
    settings: Settings, redis: RedisPool, name: str | None, port: ModelPort | None = None
) -> AsyncIterator[Judge | None]:
    """The judge of rubrics (None when `name` is None): `port` when given (a replay), else the model
    `name` as this process's settings build it (a missing key is said now, before any goal runs)."""
    if name is None:
        yield None
        return
    ledger = make_ledger(settings, redis)
    if port is not None:
        yield Judge(port, ledger)
        return
    update = {"model": name, "planner_model": None, "executor_model": None, "critic_model": None}
    models = make_models(settings.model_copy(update=update))
    try:
        models.route_of(name)  # builds it: ModelConfigError naming a missing key or an unknown model
        yield Judge(models, ledger)
    finally:
        await close_models(models)


def local_settings(settings: Settings, target: Target, prefix: str) -> Settings:
    """The settings of one local fleet: its own key prefix; the target's model for every role."""
    update: dict[str, object] = {"key_prefix": prefix}
    if target.name is not None and target.port is None:
        settings.catalog().config(target.name)  # an unknown model: ModelConfigError naming it
        update.update(model=target.name, planner_model=None, executor_model=None, critic_model=None)
    return settings.model_copy(update=update)


async def run_local(
    settings: Settings,
    cases: Sequence[Case],
    targets: Sequence[Target],
    *,
    repeat: int,
    concurrency: int,
    run_id: str,
    on_run: Callable[[RunRecord], None] | None = None,
    judge: str | None = None,
) -> list[RunRecord]:
    """`judge`: the model scoring rubrics (None: no case has one)."""
    records: list[RunRecord] = []
    for n, target in enumerate(targets):
        s = local_settings(settings, target, f"{settings.key_prefix}eval-{run_id}-{n}:")
        port = MissLog(target.port) if target.port is not None else None
        if port is None:
            await preflight(s)  # no key, a toolkit that does not import: said now, not as a hung goal
        stop = asyncio.Event()
        workers = asyncio.create_task(run_workers(list(ROLES), s, stop=stop, model=port, signals=False))

        def alive(workers: asyncio.Task[None] = workers) -> None:
            if workers.done():
                workers.result()  # raises the workers' error
                raise RuntimeError("the in-process workers stopped before the suite ended")

        try:
            async with (
                connect(s.redis_url, s.home, share=s.redis_shared_connection) as redis,
                judging(s, redis, judge, port if target.replay else None) as judged_by,
            ):
                client = Client(redis, keys_for(s), s.default_budget_tokens, s.events_maxlen)
                fleet = Fleet(client, port, alive, {"eval_run": run_id}, judged_by)
                try:
                    label = target.label(settings, local=True)
                    records += await _run_jobs(fleet, jobs_for(cases, label, None, repeat), concurrency, on_run)
                finally:
                    stop.set()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await workers
                    await _forget(redis, s.key_prefix)
        finally:
            stop.set()
            if not workers.done():
                workers.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await workers
    return records


async def run_remote(
    settings: Settings,
    cases: Sequence[Case],
    targets: Sequence[Target],
    *,
    repeat: int,
    concurrency: int,
    run_id: str,
    on_run: Callable[[RunRecord], None] | None = None,
    judge: str | None = None,
) -> list[RunRecord]:
    if any(t.port is not None for t in targets):
        raise ValueError("a model object (a replay) runs only on a local fleet")
    async with (
        connect(settings.redis_url, settings.home, share=settings.redis_shared_connection) as redis,
        judging(settings, redis, judge) as judged_by,
    ):
        client = Client(redis, keys_for(settings), settings.default_budget_tokens, settings.events_maxlen)
        missing = await health.missing_roles(redis, client.keys, ROLES)
        if missing:
            roles = ", ".join(missing)
            raise NoFleet(f"no live {roles} worker on this Redis: start `taskloom worker all`, or pass --local")
        fleet = Fleet(client, labels={"eval_run": run_id}, judge=judged_by)
        jobs = [j for t in targets for j in jobs_for(cases, t.label(settings, local=False), t.name, repeat)]
        return await _run_jobs(fleet, jobs, concurrency, on_run)


def new_run_id() -> str:
    return uuid.uuid4().hex[:10]


def order(records: Sequence[RunRecord], cases: Sequence[Case], models: Sequence[str]) -> list[RunRecord]:
    """Records by model, then case (suite order), then repeat: the order reports list them in."""
    case_at: Mapping[str, int] = {c.id: i for i, c in enumerate(cases)}
    model_at: Mapping[str, int] = {m: i for i, m in enumerate(models)}
    return sorted(records, key=lambda r: (model_at.get(r.model, 0), case_at.get(r.case, 0), r.repeat))
