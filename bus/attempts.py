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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from llm.types import Message, ModelResponse, Usage

from .batch import ScriptCall, run_scripts
from .events import encode
from .keys import Keys
from .schemas import Event, TaskResult

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


# KEYS: lease, leases zset, results hash. ARGV: holder, ttl_ms, now_ms, member, result field.
# Returns {'ok', epoch, started_ms, stored result or ''} or {'held', epoch}. The attempt's stored
# result comes back with the lease (a re-run finds it without another round trip).
_ACQUIRE = """
local h = redis.call('HMGET', KEYS[1], 'expires_ms', 'holder', 'epoch', 'started_ms')
local exp = tonumber(h[1] or '0')
if exp > tonumber(ARGV[3]) and h[2] ~= ARGV[1] then
  return {'held', h[3] or '0'}
end
local epoch = tonumber(h[3] or '0') + 1
local started = h[4] or ARGV[3]
local expires = tonumber(ARGV[3]) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'epoch', epoch, 'holder', ARGV[1], 'expires_ms', expires, 'started_ms', started)
redis.call('ZADD', KEYS[2], expires, ARGV[4])
return {'ok', tostring(epoch), started, redis.call('HGET', KEYS[3], ARGV[5]) or ''}
"""

# KEYS: lease, leases zset. ARGV: epoch, ttl_ms, now_ms, member. Returns 1, or 0 if the lease was lost.
_RENEW = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
local expires = tonumber(ARGV[3]) + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'expires_ms', expires)
redis.call('ZADD', KEYS[2], expires, ARGV[4])
return 1
"""

# KEYS: lease, leases zset. ARGV: epoch, member. The attempt is over: nobody needs to resume it.
_FINISH = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'expires_ms', 0, 'holder', '')
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS: lease, leases zset. ARGV: epoch, member, watchdog time (ms). The holder gives the attempt up
# unfinished (its worker is shutting down, or its job will be re-run later): the epoch moves on, so
# any late write or renewal of the old holder fails, and the lease is free now so that the next
# `execute` job takes it at once; the watchdogs resume it at the given time if no such job comes.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'expires_ms', 0, 'holder', '')
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return 1
"""

# KEYS: lease, pending, [goal stream, global stream]. ARGV: epoch, event JSON ('' = none), stream
# maxlen, then field/value pairs. Returns 1, or 0 if the lease was lost (nothing written).
# The event (a tool call's audit record) is appended with the outcome it reports: one round trip.
_PENDING_SET = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
local pairs = {}
for i = 4, #ARGV do pairs[#pairs + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(pairs))
if ARGV[2] ~= '' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[2])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', tonumber(ARGV[3]) * 10, '*', 'e', ARGV[2])
end
return 1
"""

# KEYS: lease, steps, pending, task record. ARGV: epoch, expected index, step JSON, '1' to read the
# task. Appends the step only at its index (a duplicate append is a no-op) and clears the pending
# step. Returns {1 appended | 2 already there, the task's state, its attempt} (state '' when not
# read), or {0} when the lease was lost. The task's state rides along for the check before the next
# model call (cancelled? moved on to another attempt?), which then needs no read of its own.
_APPEND_STEP = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return {0} end
local status = 2
if redis.call('LLEN', KEYS[2]) <= tonumber(ARGV[2]) then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('DEL', KEYS[3])
  status = 1
end
if ARGV[4] ~= '1' then return {status, '', '0'} end
local task = redis.call('HMGET', KEYS[4], 'state', 'attempt')
return {status, task[1] or '', task[2] or '0'}
"""

# KEYS: lease, results hash. ARGV: epoch, field, result JSON. Returns 1 stored, 2 already there, 0 lost.
_SAVE_RESULT = """
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 1 then return 1 end
return 2
"""

# Claims an expired lease for resumption so that only one watchdog re-enqueues it per period.
# KEYS: leases zset. ARGV: member, now_ms, new score. Returns 1 if claimed.
_CLAIM_EXPIRED = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""


# How long the task state read by `append_step` stands in for a read of the task: the check before
# the next model call comes right after it, in the same loop iteration.
TASK_SEEN_S = 0.5


def now_ms() -> int:
    return int(time.time() * 1000)


class AttemptStore:
    """Checkpoints of one task attempt, written under its lease."""

    def __init__(
        self, redis: Redis, keys: Keys, goal_id: str, task_id: str, attempt: int, events_maxlen: int = 10_000
    ) -> None:
        self.redis = redis
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
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._finish = redis.register_script(_FINISH)
        self._release = redis.register_script(_RELEASE)
        self._pending_set = redis.register_script(_PENDING_SET)
        self._append = redis.register_script(_APPEND_STEP)
        self._save_result = redis.register_script(_SAVE_RESULT)
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
        ok = await self._pending_set(
            keys=[self.lease_key, self.pending_key, *self.streams],
            args=[self.epoch, body, self.events_maxlen, *pairs],
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
        out = await self._append(
            keys=[self.lease_key, self.steps_key, self.pending_key, self.task_key],
            args=[self.epoch, step.index, step.model_dump_json(), int(read_task)],
        )
        if not int(out[0]):
            raise LeaseLost(self.member, self.epoch)
        state = out[1].decode() if isinstance(out[1], bytes) else str(out[1])
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
        out = await self._save_result(
            keys=[self.lease_key, self.results_key],
            args=[self.epoch, self.keys.result_field(result.task_id, result.attempt), result.model_dump_json()],
        )
        if not out:
            raise LeaseLost(self.member, self.epoch)
        return int(out) == 1


async def claim_expired(redis: Redis, keys: Keys, limit: int, hold_for: float) -> list[tuple[str, str, int]]:
    """Attempts whose lease expired (their executor died), each claimed for one resumption."""
    now = now_ms()
    members = await redis.zrangebyscore(keys.leases(), "-inf", now, start=0, num=limit)
    script = redis.register_script(_CLAIM_EXPIRED)
    claimed = []
    for raw in members:
        member = raw.decode() if isinstance(raw, bytes) else str(raw)
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
