"""Live text: the words of a model call while it writes them, for whoever watches the goal.

Ephemeral by design, beside the durable event stream (which keeps one event per step, never per
token): one Redis Pub/Sub channel per goal (`Keys.live`), nothing stored. A watcher that joins late
gets the text from the moment it joined (each frame says its offset in the call's text), and the
complete text of every finished step from the durable events and results, as before.

The writer's side (`LivePublisher`, one per worker process; `LiveCall`, one per model call) is a
`llm.port.TextSink`: the adapter hands it each delta synchronously; it only buffers. A batch goes
out when `flush_due` says so (`Batching`: at most one message per `interval`, or sooner once
`max_chars` are waiting), as one PUBLISH, sent in order by a chain of tasks so the model's read loop
never waits for Redis. Nobody listening costs no PUBLISH: `PUBSUB CHANNELS` (which of the fleet's
live channels have a subscriber, for every goal at once) is asked at most once per `listener_ttl`
per process, and while the answer is fresh "nobody", a batch is only counted.

Frames (JSON): `{"type": "text", goal, task, attempt, step, offset, text}`, and `{"type":
"restart", goal, task, attempt, step}` when a step may be written again from its first word (a new
executor resumed the attempt after a crash, a job re-ran after a model error, a failover moved the
call to the next model): a watcher drops what it holds of that task's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.asyncio import Redis

from .keys import Keys
from .replies import as_str

log = structlog.get_logger("taskloom.live")


@dataclass(frozen=True)
class Batching:
    """How text is grouped into messages: at most one per `interval` seconds, or one as soon as
    `max_chars` characters are waiting, whichever comes first."""

    interval: float = 0.1
    max_chars: int = 400


def flush_due(pending_chars: int, since_flush: float, batching: Batching) -> bool:
    """Whether the waiting text goes out now (`since_flush`: seconds since the call's last batch,
    or since it started)."""
    if pending_chars <= 0:
        return False
    return pending_chars >= batching.max_chars or since_flush >= batching.interval


class LiveFrame(BaseModel):
    """One message of a goal's live channel, as a watcher reads it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    type: Literal["text", "restart"]
    goal: str
    task: str
    attempt: int = Field(ge=1)
    step: int = Field(ge=0)
    offset: int = Field(default=0, ge=0, description="where `text` starts in the call's text")
    text: str = ""


# How long "nobody watches this goal" is believed: a watcher who opens the page (or the SSE stream)
# right after a call asked is noticed by the calls that start this much later. Short, because a call
# made unstreamed stays so to its end. The question is one `PUBSUB CHANNELS` for every goal at once
# (which of the fleet's live channels have a subscriber), asked only as a call starts and shared by
# the process's calls: a process nobody watches pays at most one round trip per this many seconds,
# however many goals it runs (a question per goal cost a wide fan-out a round trip per call).
LISTENER_TTL_S = 0.25


def _glob_escaped(text: str) -> str:
    """`text` matched literally by a Redis glob pattern (a key prefix may hold `*`, `?`, `[` or `\\`)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class LivePublisher:
    """The process's writer of live text: hands out a `LiveCall` per model call, and remembers, for
    `listener_ttl` seconds, which goals anyone listens to."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        batching: Batching | None = None,
        listener_ttl: float = LISTENER_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.batching = batching or Batching()
        self.listener_ttl = listener_ttl
        self.clock = clock
        # goal -> (learnt at, anyone listening), from the replies of this process's PUBLISHes
        self._listeners: dict[str, tuple[float, bool]] = {}
        # (asked at, the goals whose channel had a subscriber then), from the last PUBSUB CHANNELS
        self._watched: tuple[float, frozenset[str]] | None = None
        self._check: asyncio.Future[tuple[float, frozenset[str]]] | None = None  # the question in flight
        self._channel_prefix = keys.live("")

    async def sink(
        self, goal_id: str, task_id: str, attempt: int, step: int, *, restart: bool = False
    ) -> LiveCall | None:
        """The sink of one model call when someone watches the goal now, else None: the call is then
        made without streaming at all (a plain reply costs the worker far less CPU than a stream's
        hundreds of reads), and a watcher who arrives mid-call sees the step when it is stored.
        Never raises: a Redis that cannot answer the question means no live text, not a failed call."""
        try:
            if not await self.listening(goal_id):
                return None
        except Exception as exc:
            log.debug("live.check_failed", goal_id=goal_id, error=repr(exc))
            return None
        return self.call(goal_id, task_id, attempt, step, restart=restart)

    def call(self, goal_id: str, task_id: str, attempt: int, step: int, *, restart: bool = False) -> LiveCall:
        """The sink of one model call writing step `step` of the attempt; `restart`: the step may
        have been streamed before (by this attempt's earlier run), so watchers are told to drop it."""
        live = LiveCall(self, goal_id, task_id, attempt, step)
        if restart:
            live.restart()
        return live

    def _known(self, goal_id: str, now: float) -> bool | None:
        """Whether anyone listens to the goal, as last learnt and still believed; None: ask again.
        The newer of a PUBLISH's reply and the last snapshot wins. "Someone" (a PUBLISH reached a
        listener) is believed 30 x longer than "nobody": a watcher who left costs one PUBLISH, whose
        reply ("0 received") corrects it."""
        seen, snap, ttl = self._listeners.get(goal_id), self._watched, self.listener_ttl
        if seen is not None and (snap is None or seen[0] >= snap[0]):
            if now - seen[0] < (ttl * 30 if seen[1] else ttl):
                return seen[1]
        if snap is not None and now - snap[0] < ttl:
            return goal_id in snap[1]
        if seen is not None and seen[1] and now - seen[0] < ttl * 30:
            return True
        return None

    def silent(self, goal_id: str) -> bool:
        """True while the last check (younger than `listener_ttl`) found nobody listening."""
        return self._known(goal_id, self.clock()) is False

    async def listening(self, goal_id: str) -> bool:
        """Whether anyone listens to the goal's channel: known, else one `PUBSUB CHANNELS` of the
        fleet's live channels, shared by every call of this process that asks while it is in flight."""
        known = self._known(goal_id, self.clock())
        if known is not None:
            return known
        if self._check is None:
            check = asyncio.ensure_future(self._channels())
            self._check = check

            def done(_: object) -> None:
                if self._check is check:
                    self._check = None

            check.add_done_callback(done)
        _, watched = await asyncio.shield(self._check)
        return goal_id in watched

    async def _channels(self) -> tuple[float, frozenset[str]]:
        asked = self.clock()
        reply = await self.redis.pubsub_channels(_glob_escaped(self._channel_prefix) + "*")
        n = len(self._channel_prefix)
        snap = (asked, frozenset(as_str(c)[n:] for c in reply))
        if len(self._listeners) > 1024:  # forget goals not heard of lately
            self._listeners = {g: v for g, v in self._listeners.items() if asked - v[0] < self.listener_ttl * 30}
        self._watched = snap
        return snap

    async def send(self, goal_id: str, frame: dict[str, Any]) -> None:
        """PUBLISH `frame` if anyone listens. Never raises: live text is a courtesy to watchers, and
        a Redis hiccup must not fail the model call (the durable steps carry every word anyway)."""
        try:
            if await self.listening(goal_id):
                heard = await self.redis.publish(self.keys.live(goal_id), json.dumps(frame, separators=(",", ":")))
                # PUBLISH answers how many received it: the listener check, renewed at no cost.
                self._listeners[goal_id] = (self.clock(), int(heard) > 0)
        except Exception as exc:
            log.debug("live.publish_failed", goal_id=goal_id, error=repr(exc))


class LiveCall:
    """The `llm.port.TextSink` of one model call: buffers the deltas and sends them in batches, in
    order. `close()` (awaited when the call ends, however it ends) sends what is left."""

    def __init__(self, publisher: LivePublisher, goal_id: str, task_id: str, attempt: int, step: int) -> None:
        self.publisher = publisher
        self.goal_id = goal_id
        self.head: dict[str, Any] = {"goal": goal_id, "task": task_id, "attempt": attempt, "step": step}
        self._pending: list[str] = []
        self._pending_chars = 0
        self.offset = 0  # characters of the call's text already sent (or counted while nobody listened)
        self._flushed_at = publisher.clock()
        self._timer: asyncio.TimerHandle | None = None
        self._last: asyncio.Future[None] | None = None  # the newest send: each waits for the one before

    def __call__(self, text: str) -> None:
        self._pending.append(text)
        self._pending_chars += len(text)
        now = self.publisher.clock()
        if flush_due(self._pending_chars, now - self._flushed_at, self.publisher.batching):
            self._flush(now)
        elif self._timer is None:
            # A model that pauses mid-reply: what waits still goes out within one interval.
            wait = max(0.0, self.publisher.batching.interval - (now - self._flushed_at))
            self._timer = asyncio.get_running_loop().call_later(wait, self._on_timer)

    def restart(self) -> None:
        """The call's text so far is void (it is written again from its first word): watchers are told."""
        self._pending.clear()
        self._pending_chars = 0
        self.offset = 0
        self._chain({"type": "restart", **self.head})

    def _on_timer(self) -> None:
        self._timer = None
        if self._pending_chars:
            self._flush(self.publisher.clock())

    def _flush(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        text = "".join(self._pending)
        self._pending.clear()
        self._pending_chars = 0
        offset, self.offset, self._flushed_at = self.offset, self.offset + len(text), now
        if self.publisher.silent(self.goal_id):
            return  # nobody listens (asked within listener_ttl): the batch is only counted
        self._chain({"type": "text", **self.head, "offset": offset, "text": text})

    def _chain(self, frame: dict[str, Any]) -> None:
        before = self._last

        async def send() -> None:
            if before is not None:
                await before
            await self.publisher.send(self.goal_id, frame)

        self._last = asyncio.ensure_future(send())

    async def close(self) -> None:
        """Send what is still waiting, and wait until every batch of the call is out (again and
        again: a sink flushed by the metered model is closed by its caller too)."""
        await self.flush()

    async def flush(self) -> None:
        """Send what is still waiting, and wait until every batch sent so far is out."""
        if self._pending_chars:
            self._flush(self.publisher.clock())
        elif self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._last is not None:
            with contextlib.suppress(Exception):
                await self._last


# -- the watcher's side ---------------------------------------------------------------------------


def parse_frame(data: bytes | str) -> LiveFrame | None:
    """A channel message as a frame, or None (logged) for one that is not: a watcher skips it."""
    try:
        return LiveFrame.model_validate_json(data)
    except ValidationError as exc:
        log.warning("live.bad_frame", error=str(exc.errors(include_url=False)[:1]))
        return None


@dataclass
class TaskText:
    """The text a watcher holds for one task: that of its latest streamed call."""

    attempt: int
    step: int
    text: str = ""
    gap: bool = False  # joined mid-call: the text's start was never seen
    restarted: int = 0  # restart frames seen for the task


class LiveTexts:
    """A watcher's view of a goal's live text, one `TaskText` per task (the console's rule, in
    Python): a frame's text lands at its `offset` (`held[:offset] + text`, so a call that starts
    again at 0 replaces what was held); a newer attempt or step starts afresh; `restart` clears."""

    def __init__(self) -> None:
        self.tasks: dict[str, TaskText] = {}

    def apply(self, frame: LiveFrame) -> TaskText:
        held = self.tasks.get(frame.task)
        if frame.type == "restart":
            count = held.restarted + 1 if held is not None else 1
            self.tasks[frame.task] = TaskText(frame.attempt, frame.step, restarted=count)
            return self.tasks[frame.task]
        if held is None or (frame.attempt, frame.step) != (held.attempt, held.step):
            held = TaskText(frame.attempt, frame.step, restarted=held.restarted if held is not None else 0)
            self.tasks[frame.task] = held
        if frame.offset > len(held.text):
            held.text, held.gap = held.text + frame.text, True
        else:
            held.text = held.text[: frame.offset] + frame.text
        return held


class Subscription:
    """A watcher's subscription to one goal's live channel (its own Redis connection while open)."""

    def __init__(self, redis: Redis, keys: Keys, goal_id: str) -> None:
        self.channel = keys.live(goal_id)
        self._pubsub = redis.pubsub(ignore_subscribe_messages=True)

    async def __aenter__(self) -> Subscription:
        await self._pubsub.subscribe(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self._pubsub.unsubscribe(self.channel)
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def next(self, timeout: float) -> LiveFrame | None:
        """The next frame, or None when none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            if message is None or message.get("type") != "message":
                continue
            frame = parse_frame(message["data"])
            if frame is not None:
                return frame

    async def frames(self, timeout: float) -> AsyncIterator[LiveFrame | None]:
        """Frames as they come, and None after each quiet `timeout` (a chance to check the goal)."""
        while True:
            yield await self.next(timeout)
