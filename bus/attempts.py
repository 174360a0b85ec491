"""Attempt persistence: each task attempt's ReAct steps, checkpointed in Redis under a fenced lease,
and the lease set the executors' watchdogs read. The executor's loop decides; this module stores.

Keys (from `Keys.attempt_lease/attempt_steps/attempt_pending(goal, task, attempt)`):
* `:lease`   hash  epoch, holder, expires_ms, started_ms (the attempt's first start; deadlines count from it)
* `:steps`   list  completed StepRecord JSON, in order
* `:pending` hash  the step in progress: `turn` (the model's reply, stored before any tool runs, so a
                   crash never pays for the same model call twice), `started:<call>` and
                   `result:<call>` per tool call.

Every write runs in a Lua script that first checks the caller's lease epoch. arq can start a second
copy of a job while the first still runs; the lease makes sure only one of them can write, and an
executor whose lease was taken over is told so (`LeaseLost`) at its next write.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from llm.types import Message, ModelResponse, Usage

from .batch import ScriptCall, run_scripts
from .events import encode
from .keys import Keys
from .replies import as_str
from .schemas import Event, TaskResult
from .scripts import Script, module_scripts, registered

if TYPE_CHECKING:
    from .ledger import Ledger

# How one tool call ended (the gateway decides; the step record keeps it). `repeated`: answered
# with a warning instead of running (an identical call already succeeded); `loop`: repeated again
# after that warning, which ends the attempt (`loop_detected`).
Outcome = Literal[
    "ok",
    "not_allowed",
    "unknown_tool",
    "invalid_args",
    "error",
    "timeout",
    "denied",
    "unknown_outcome",
    "cancelled",
    "repeated",
    "loop",
]


class ToolOutcome(BaseModel):
    """One call's result: what the model sees, and the full output kept in the step record."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    tool: str
    outcome: Outcome
    content: str  # for the model (maybe truncated)
    full: str  # untruncated
    seconds: float = 0.0

    @property
    def is_error(self) -> bool:
        return self.outcome != "ok"


class LeaseLost(Exception):
    """Another executor holds this attempt now; stop without writing anything."""

    def __init__(self, member: str, epoch: int) -> None:
        super().__init__(f"lease of {member} lost (epoch {epoch} is no longer current)")
        self.member = member
        self.epoch = epoch

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.member, self.epoch))


class StepRecord(BaseModel):
    """One completed step: the model's turn and what we answered (tool results, nudges)."""

    model_config = ConfigDict(frozen=True)

    index: int = Field(ge=0)
    assistant: Message
    reply: Message | None = None  # the next user message: tool_results first, then any nudge text
    outcomes: list[ToolOutcome] = Field(default_factory=list)  # full outputs, untruncated
    usage: Usage = Field(default_factory=Usage)
    stop_reason: str
    notes: list[str] = Field(default_factory=list)  # nudges given at this step (see executor.policy)


class Pending(BaseModel):
    """The step in progress, as read back after a crash."""

    turn: ModelResponse | None = None
    started: set[str] = Field(default_factory=set)
    results: dict[str, ToolOutcome] = Field(default_factory=dict)


# The scripts (bus/lua/): each file's header says its KEYS, ARGV and reply.
_ACQUIRE, _RENEW, _FINISH, _RELEASE, _PENDING_SET, _APPEND_STEP, _SAVE_RESULT, _CLAIM_EXPIRED = module_scripts(
    "attempts", "acquire", "renew", "finish", "release", "pending_set", "append_step", "save_result", "claim_expired"
)


# How long the task state read by `append_step` stands in for a read of the task: the check before
# the next model call comes right after it, in the same loop iteration.
TASK_SEEN_S = 0.5


def now_ms() -> int:
    return int(time.time() * 1000)


class AttemptStore:
    """Checkpoints of one task attempt, written under its lease."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        goal_id: str,
        task_id: str,
        attempt: int,
        events_maxlen: int = 10_000,
        ledger: Ledger | None = None,
    ) -> None:
        """`ledger`: the process's, whose held settles (`bus.ledger`) ride on this attempt's writes:
        a model call's settle goes out with the step or turn stored right after it."""
        self.redis = redis
        self.ledger = ledger
        self.keys = keys
        self.events_maxlen = events_maxlen
        self.streams = [keys.goal_events(goal_id), keys.global_events()]
        self.lease_key = keys.attempt_lease(goal_id, task_id, attempt)
        self.steps_key = keys.attempt_steps(goal_id, task_id, attempt)
        self.pending_key = keys.attempt_pending(goal_id, task_id, attempt)
        self.member = keys.lease_member(goal_id, task_id, attempt)
        self.task_key = keys.task(goal_id, task_id)
        self._task_seen: tuple[str, int, float] | None = None  # see `task_seen`
        self.epoch = 0
        self.started_ms = 0
        # True from taking the lease first (epoch 1) until this store writes: every step and pending
        # step is written under a lease, so none can exist yet, and reading them back is skipped.
        self._empty = False
        # The turn this store wrote as the first thing under a first lease (a routed task's seeded
        # turn): until its next write, the attempt is known to hold just that, and is not read back.
        self._only_turn: ModelResponse | None = None
        self._acquire = registered(redis, _ACQUIRE)
        self._renew = registered(redis, _RENEW)
        self._finish = registered(redis, _FINISH)
        self._release = registered(redis, _RELEASE)
        self._pending_set = registered(redis, _PENDING_SET)
        self._append = registered(redis, _APPEND_STEP)
        self._save_result = registered(redis, _SAVE_RESULT)
        self.results_key = keys.results(goal_id)
        self.result_field = keys.result_field(task_id, attempt)
        # The attempt's result as stored when the lease was taken (raw JSON), None if none was.
        self.stored_result: bytes | str | None = None

    async def acquire(self, holder: str, ttl: float) -> bool:
        """Take the lease (a new epoch) unless another live holder has it."""
        (reply,) = await run_scripts(self.redis, [self.acquire_call(holder, ttl)])
        return self.acquired(reply)

    def acquire_call(self, holder: str, ttl: float) -> ScriptCall:
        """`acquire`, to send with other calls (`bus.batch`); its reply goes to `acquired`."""
        # Guarded (`bus.durability`): a lease taken on a master that a failover then loses would let
        # another executor take the same epoch number on the new master, and both would write.
        return ScriptCall(
            self._acquire,
            [self.lease_key, self.keys.leases(), self.results_key],
            [holder, int(ttl * 1000), now_ms(), self.member, self.result_field],
            guarded="attempt lease",
        )

    def acquired(self, out: Any) -> bool:
        """The outcome of an `acquire_call`: True (this store now holds the lease) or False (another
        live holder has it); an exception in place of the reply (Redis trouble) is raised."""
        if isinstance(out, BaseException):
            raise out
        if out[0] in (b"held", "held"):
            return False
        self.epoch = int(out[1])
        self.started_ms = int(out[2])
        self._empty = self.epoch == 1
        self._only_turn = None
        self.stored_result = out[3] or None
        return True

    async def renew(self, ttl: float) -> None:
        ok = await self._renew(
            keys=[self.lease_key, self.keys.leases()], args=[self.epoch, int(ttl * 1000), now_ms(), self.member]
        )
        if not ok:
            raise LeaseLost(self.member, self.epoch)

    def renew_in(self, pipe: Any, ttl_ms: int, now: int) -> Any:
        """Queue this lease's renewal on `pipe` (bus.renewals batches them); the reply is 1, or 0
        when the lease was lost. Returns the script, which must be loaded on the server."""
        pipe.evalsha(self._renew.sha, 2, self.lease_key, self.keys.leases(), self.epoch, ttl_ms, now, self.member)
        return self._renew

    async def finish(self) -> None:
        call = self.finish_call()
        await call.script(keys=call.keys, args=call.args)

    def finish_call(self) -> ScriptCall:
        """The attempt is over: the lease's end, to send with other calls (`bus.batch`)."""
        return ScriptCall(self._finish, [self.lease_key, self.keys.leases()], [self.epoch, self.member])

    async def release(self, watchdog_after: float = 0.0) -> bool:
        """Give the unfinished attempt up for another executor to resume now (not after the TTL).
        The watchdogs leave it alone for `watchdog_after` seconds (its own job is re-run meanwhile).
        False if the lease was no longer ours."""
        at = now_ms() + int(watchdog_after * 1000)
        out = await self._release(keys=[self.lease_key, self.keys.leases()], args=[self.epoch, self.member, at])
        return bool(out)

    async def steps(self) -> list[StepRecord]:
        if self._empty or self._only_turn is not None:
            return []
        rows = await self.redis.lrange(self.steps_key, 0, -1)  # type: ignore[misc]
        return [StepRecord.model_validate_json(r) for r in rows]

    async def pending(self) -> Pending:
        if self._empty:
            return Pending()
        if self._only_turn is not None:
            return Pending(turn=self._only_turn)
        raw = {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in (await self.redis.hgetall(self.pending_key)).items()  # type: ignore[misc]
        }
        turn = ModelResponse.model_validate_json(raw["turn"]) if "turn" in raw else None
        started = {k.removeprefix("started:") for k in raw if k.startswith("started:")}
        results = {
            k.removeprefix("result:"): ToolOutcome.model_validate_json(v)
            for k, v in raw.items()
            if k.startswith("result:")
        }
        return Pending(turn=turn, started=started, results=results)

    async def _set(self, *pairs: str, event: Event | None = None) -> None:
        self._empty = False
        self._only_turn = None
        body = encode(event) if event is not None else ""
        ok = await self._write(
            self._pending_set,
            [self.lease_key, self.pending_key, *self.streams],
            [self.epoch, body, self.events_maxlen, *pairs],
        )
        if not ok:
            raise LeaseLost(self.member, self.epoch)

    async def save_turn(self, response: ModelResponse) -> None:
        first = self._empty
        await self._set("turn", response.model_dump_json())
        if first:
            self._only_turn = response

    async def mark_started(self, call_id: str) -> None:
        await self._set(f"started:{call_id}", "1")

    async def save_outcome(self, outcome: ToolOutcome, event: Event | None = None) -> None:
        """Store a call's outcome, and with it (same script) its audit `event` on the goal's streams."""
        await self._set(f"result:{outcome.call_id}", outcome.model_dump_json(), event=event)

    async def append_step(self, step: StepRecord, *, read_task: bool = True) -> None:
        """Store a completed step; `read_task`: also read the task's state for `task_seen` (not
        wanted after the last step of an attempt)."""
        self._empty = False
        self._only_turn = None
        out = await self._write(
            self._append,
            [self.lease_key, self.steps_key, self.pending_key, self.task_key],
            [self.epoch, step.index, step.model_dump_json(), int(read_task)],
        )
        if not int(out[0]):
            raise LeaseLost(self.member, self.epoch)
        state = as_str(out[1])
        self._task_seen = (state, int(out[2]), time.monotonic()) if state else None

    def task_seen(self, within: float = TASK_SEEN_S) -> tuple[str, int] | None:
        """The task's (state, attempt) as the last `append_step` read them in its script, once, and
        only within `within` seconds of it; None otherwise (the caller reads the task itself)."""
        seen, self._task_seen = self._task_seen, None
        if seen is None or time.monotonic() - seen[2] > within:
            return None
        return seen[0], seen[1]

    async def save_result(self, result: TaskResult) -> bool:
        """Store the attempt's result under the lease; False if a result was already stored."""
        out = await self._write(
            self._save_result,
            [self.lease_key, self.results_key],
            [self.epoch, self.keys.result_field(result.task_id, result.attempt), result.model_dump_json()],
        )
        if not out:
            raise LeaseLost(self.member, self.epoch)
        return int(out) == 1

    async def _write(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """Run one of the attempt's write scripts. The settles the process holds go first, in the same
        round trip (each script atomic on its own): the executor's model calls then cost the ledger
        one round trip each (the reserve), and the books are exact as soon as a step is stored."""
        carried = self.ledger.held_call() if self.ledger is not None else None
        if carried is None:
            return await script(keys=keys, args=args)
        assert self.ledger is not None
        close, held = carried
        try:
            closed, out = await run_scripts(self.redis, [close, ScriptCall(script, keys, args)])
        except BaseException as exc:  # the round trip failed: the closes may not have run
            self.ledger.held_done(held, exc)
            raise
        self.ledger.held_done(held, closed)
        if isinstance(out, BaseException):
            raise out
        return out


async def claim_expired(redis: Redis, keys: Keys, limit: int, hold_for: float) -> list[tuple[str, str, int]]:
    """Attempts whose lease expired (their executor died), each claimed for one resumption."""
    now = now_ms()
    members = await redis.zrangebyscore(keys.leases(), "-inf", now, start=0, num=limit)
    script = registered(redis, _CLAIM_EXPIRED)
    claimed = []
    for raw in members:
        member = as_str(raw)
        if await script(keys=[keys.leases()], args=[member, now, now + int(hold_for * 1000)]):
            claimed.append(keys.parse_lease_member(member))
    return claimed


async def drop_lease(redis: Redis, keys: Keys, goal_id: str, task_id: str, attempt: int) -> None:
    """Forget an attempt in the lease set (it ended; no watchdog needs to resume it)."""
    await redis.zrem(keys.leases(), keys.lease_member(goal_id, task_id, attempt))


async def leased(redis: Redis, keys: Keys, goal_id: str, attempts: dict[str, int]) -> set[str]:
    """Which of the goal's tasks (task id -> current attempt) have their attempt in the lease set."""
    if not attempts:
        return set()
    ids = list(attempts)
    async with redis.pipeline(transaction=False) as pipe:
        for t in ids:
            pipe.zscore(keys.leases(), keys.lease_member(goal_id, t, attempts[t]))
        scores = await pipe.execute()
    return {t for t, score in zip(ids, scores, strict=True) if score is not None}
