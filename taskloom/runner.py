"""`taskloom run` and `taskloom demo`: submit one goal, show its progress live, return how it ended.

With `local`, the three roles run in this process (on the same Redis), so one command is a whole
system; without it, the goal is handed to whatever workers are running.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text
from rich.tree import Tree

from bus.client import Client, GoalStatus
from bus.connection import connect
from bus.consoles import console_url
from bus.keys import ROLES
from bus.ledger import Ledger, LedgerNotFound, LedgerSnapshot
from bus.live import LiveTexts, TaskText
from bus.schemas import Goal, GoalRecord, TaskState
from llm.port import ModelPort

from . import health
from .settings import Settings
from .terminal import clean, line
from .workers import close_models, keys_for, load_tools, make_models, run_workers

# Seconds between checks that every role has a live worker, while a goal is followed.
WORKER_CHECK_EVERY = 5.0

STATE_STYLE = {
    TaskState.PENDING: "dim",
    TaskState.READY: "cyan",
    TaskState.RUNNING: "yellow",
    TaskState.WAITING_APPROVAL: "magenta",
    TaskState.REVIEWING: "blue",
    TaskState.RETRYING: "bold yellow",
    TaskState.DONE: "green",
    TaskState.FAILED: "red",
    TaskState.CANCELLED: "red",
    TaskState.SUPERSEDED: "dim strike",
}


# A running task's live text shows its last lines, up to this many characters.
TAIL_CHARS = 600
WRITING = {TaskState.RUNNING, TaskState.READY, TaskState.RETRYING}


def tail(text: str, limit: int = TAIL_CHARS) -> str:
    """The end of `text`, from a line start when there is one within `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    return "…" + (cut.split("\n", 1)[1] if "\n" in cut[:-1] else cut)


def _writing(held: TaskText) -> Text:
    mark = f"writing (attempt {held.attempt}, restarted)" if held.restarted else "writing"
    return line((f"{mark}: ", "italic dim"), ("…" if held.gap else "") + tail(held.text))


def render(
    status: GoalStatus, ledger: LedgerSnapshot | None, elapsed: float, texts: LiveTexts | None = None
) -> Group:
    goal = status.goal
    spent = f"{ledger.spent:,} / {ledger.budget:,} tokens" if ledger else f"budget {goal.budget_tokens:,}"
    head = line(
        (f"{goal.id[:12]} ", "bold"),
        (goal.state.value, "bold cyan"),
        f"  plan v{goal.plan_version}  {spent}  {elapsed:5.1f}s",
    )
    tree = Tree(head)
    specs = {t.id: t for t in status.plan.plan.tasks} if status.plan else {}
    records = {t.task_id: t for t in status.tasks}
    for task_id, spec in specs.items():
        rec = records.get(task_id)
        state = rec.state if rec else TaskState.PENDING
        deps = f" (after {', '.join(spec.depends_on)})" if spec.depends_on else ""
        attempt = f" attempt {rec.attempt}" if rec and rec.attempt > 1 else ""
        node = tree.add(line((f"{state.value:<16}", STATE_STYLE[state]), f"{task_id}: {spec.title}{deps}{attempt}"))
        if rec is not None and rec.feedback:
            # Why the critic sent it back: the retry path is the point of watching a goal live.
            node.add(line(("critic: ", "bold magenta"), _one_line(rec.feedback)))
        held = texts.tasks.get(task_id) if texts is not None else None
        if held is not None and state in WRITING and held.text:
            node.add(_writing(held))
    if texts is not None and not specs and goal.state.value == "planning":
        # A goal answered in text is answered by its first (planning) call: shown as it is written.
        for held in texts.tasks.values():
            if held.text:
                tree.add(_writing(held))
    return Group(tree)


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(clean(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


async def follow(
    client: Client,
    goal_id: str,
    console: Console,
    timeout: float | None,
    workers: asyncio.Task[None] | None = None,
    warn: Callable[[str], None] | None = None,
    stream: bool = True,
) -> GoalRecord:
    """Redraw the goal's DAG on every event until it ends (or `timeout` passes).

    `workers`: the in-process workers (`--local`); if they stop with an error (no API key, a toolkit
    that does not import), that error is raised here at once instead of the goal waiting forever.
    `warn`: told once when some role has no live worker anywhere (its heartbeats), re-checked every
    few seconds while the goal has not ended. `stream`: each running task's words show as the model
    writes them (`Client.stream`).
    """
    ledger = Ledger(client.redis, client.keys)

    async def snapshot() -> tuple[GoalStatus, LedgerSnapshot | None]:
        status = await client.status(goal_id)
        try:
            books: LedgerSnapshot | None = await ledger.snapshot(goal_id)
        except LedgerNotFound:
            books = None
        return status, books

    texts = LiveTexts()

    async def listen() -> None:
        async for frame in client.stream(goal_id):
            texts.apply(frame)

    listener = asyncio.create_task(listen()) if stream else None
    try:
        return await _redraw(client, goal_id, console, timeout, workers, warn, texts if stream else None, snapshot)
    finally:
        if listener is not None:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener


async def _redraw(
    client: Client,
    goal_id: str,
    console: Console,
    timeout: float | None,
    workers: asyncio.Task[None] | None,
    warn: Callable[[str], None] | None,
    texts: LiveTexts | None,
    snapshot: Callable[[], Awaitable[tuple[GoalStatus, LedgerSnapshot | None]]],
) -> GoalRecord:
    started = time.monotonic()
    after: str | None = None
    warned = False
    next_check = started
    status, books = await snapshot()
    with Live(render(status, books, 0, texts), console=console, refresh_per_second=8, transient=False) as live:
        while not status.goal.terminal:
            if workers is not None and workers.done():
                workers.result()  # raises the workers' error
                raise RuntimeError("the in-process workers stopped before the goal ended")
            if warn is not None and not warned and time.monotonic() >= next_check:
                next_check = time.monotonic() + WORKER_CHECK_EVERY
                missing = await health.missing_roles(client.redis, client.keys, ROLES)
                if missing:
                    warned = True
                    warn(health.no_worker_message(missing))
            if timeout is not None and time.monotonic() - started > timeout:
                break
            events = await client.log.read(goal_id, after=after, block_ms=250)
            if events:
                after = events[-1].position
            status, books = await snapshot()
            live.update(render(status, books, time.monotonic() - started, texts))
    return status.goal


async def preflight(settings: Settings) -> None:
    """What `taskloom worker` would refuse at start-up, checked before a `--local` run submits anything:
    the toolkits import and the model can be built (raises `ToolLoadError` / `ModelConfigError`)."""
    load_tools(settings)
    models = make_models(settings)
    try:
        models.start()
    finally:
        await close_models(models)


async def run_goal(
    settings: Settings,
    goal: Goal,
    *,
    local: bool,
    console: Console,
    model: ModelPort | None = None,
    timeout: float | None = None,
    warn: Callable[[str], None] | None = None,
    stream: bool = True,
) -> tuple[GoalRecord, LedgerSnapshot | None]:
    stop = asyncio.Event()
    workers: asyncio.Task[None] | None = None
    if local and model is None:
        await preflight(settings)
    async with connect(
        settings.redis_url, settings.home, settings.replica_wait, share=settings.redis_shared_connection
    ) as redis:
        client = Client(redis, keys_for(settings), settings.default_budget_tokens, settings.events_maxlen)
        if local:
            # Signals are the CLI's: a SIGTERM cancels this coroutine, and `finally` below stops the
            # workers with their usual grace.
            workers = asyncio.create_task(run_workers(list(ROLES), settings, stop=stop, model=model, signals=False))
        try:
            goal_id = await client.submit(goal)
            console.print(line("goal ", (goal_id, "bold"), ": ", goal.text), highlight=False, soft_wrap=True)
            # An API process on this Redis (`taskloom api`) registers its console: point at the goal there.
            url = await console_url(redis, client.keys)
            if url:
                console.print(line("console: ", f"{url}#/goals/{goal_id}"), highlight=False, soft_wrap=True)
            record = await follow(client, goal_id, console, timeout, workers, None if local else warn, stream)
            try:
                books: LedgerSnapshot | None = await Ledger(redis, client.keys).snapshot(goal_id)
            except LedgerNotFound:
                books = None
        finally:
            stop.set()
            if workers is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await workers
    return record, books


def summary(record: GoalRecord, books: LedgerSnapshot | None) -> dict[str, Any]:
    return {
        "goal_id": record.id,
        "state": record.state.value,
        "answer": record.answer,
        "reason": record.reason,
        "tokens_spent": books.spent if books else None,
        "budget": record.budget_tokens,
    }
