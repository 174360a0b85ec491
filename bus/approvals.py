"""Tool calls awaiting a person's decision: requests, decisions, and one inbox across all goals.

Per goal (keys from `bus.keys`): `approval-requests` (hash: call id -> `ApprovalRequest` JSON)
and `approvals` (hash: call id -> `approved` | `denied:<reason>`; `ApprovalDecision.encode/decode`
are the only code that writes or parses that form). Across goals: `approvals:pending`,
a sorted set of `<goal id> <call id>` by request time, so an inbox can list every pending call
without scanning goals. A request and a decision are each one Lua script that writes the hashes,
the inbox and the audit event together, so the inbox never disagrees with the requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis

from llm.types import ToolUseBlock

from . import events as ev
from .attempts import AttemptStore
from .keys import Keys
from .replies import as_str
from .schemas import GOAL_TERMINAL, Event, GoalState
from .scripts import lua, registered
from .store_errors import NotFound

_APPROVED = "approved"
_DENIED = "denied:"

_REQUEST = lua("approvals_request")
_DECIDE = lua("approvals_decide")


class AlreadyDecided(NotFound):
    """The call was decided before: its request is gone and the first decision stands."""

    def __init__(self, goal_id: str, call_id: str, decision: ApprovalDecision) -> None:
        super().__init__("pending approval request", f"{goal_id}/{call_id}")
        self.args = (
            f"pending approval request '{goal_id}/{call_id}' not found: it was already decided ({decision.verdict})",
        )
        self.goal_id = goal_id
        self.call_id = call_id
        self.decision = decision

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.goal_id, self.call_id, self.decision))


EARLIER_RESULT_LIMIT = 500  # characters of an earlier call's result kept on a request


class EarlierCall(BaseModel):
    """An earlier call of the same tool in the same task, as the person deciding sees it."""

    model_config = ConfigDict(frozen=True)

    attempt: int
    call_id: str
    input: dict[str, Any] = Field(default_factory=dict)
    outcome: str = Field(description="how it ended: ok, error, denied, unknown_outcome, ... (bus.attempts.Outcome)")
    result: str = Field(default="", description=f"what it returned, cut to {EARLIER_RESULT_LIMIT} characters")


class ApprovalRequest(BaseModel):
    """What a tool call awaiting approval stores: which task attempt asked, with which tool and input,
    and how the task's earlier calls of that tool ended (so the person deciding sees what already
    happened: a refund done in attempt 1 is not a new refund to approve blindly)."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    attempt: int
    tool: str
    input: dict[str, Any]
    # Optional so that a request written without its time (by hand, or by a tool of the user's
    # own) still reads: the approvals inbox keeps the time too, as the member's score.
    at: float | None = Field(default=None, description="when the call asked (Unix seconds), if it says")
    earlier: list[EarlierCall] = Field(default_factory=list, description="earlier calls of this tool in this task")


class ApprovalDecision(BaseModel):
    """A person's answer to one request; a denial's reason reaches the model."""

    model_config = ConfigDict(frozen=True)

    approved: bool
    reason: str = ""

    @property
    def verdict(self) -> Literal["approved", "denied"]:
        return "approved" if self.approved else "denied"

    def encode(self) -> str:
        """The stored form: `approved`, or `denied:<reason>`."""
        return _APPROVED if self.approved else f"{_DENIED}{self.reason}"

    @classmethod
    def decode(cls, raw: str) -> ApprovalDecision:
        if raw == _APPROVED:
            return cls(approved=True)
        return cls(approved=False, reason=raw.removeprefix(_DENIED))


class PendingApproval(BaseModel):
    """One tool call waiting for a person: which goal and task asked, for which tool, with what."""

    model_config = ConfigDict(frozen=True)

    goal_id: str
    call_id: str
    task_id: str
    attempt: int
    tool: str
    arguments: dict[str, Any] = Field(description="the arguments the model wrote, as it wrote them")
    requested_at: float = Field(description="when the call asked (Unix seconds)")
    earlier: list[EarlierCall] = Field(default_factory=list, description="earlier calls of this tool in this task")


def member(goal_id: str, call_id: str) -> str:
    # Goal ids never contain a space (GOAL_ID_PATTERN), so the first space splits the two.
    return f"{goal_id} {call_id}"


class ApprovalBook:
    def __init__(self, redis: Redis, keys: Keys, events_maxlen: int = 10_000) -> None:
        self.redis = redis
        self.keys = keys
        self.maxlen = events_maxlen
        self._request = registered(redis, _REQUEST)
        self._decide = registered(redis, _DECIDE)

    def _keys(self, goal_id: str) -> list[str]:
        return [
            self.keys.approval_requests(goal_id),
            self.keys.approvals(goal_id),
            self.keys.approvals_pending(),
            self.keys.goal_events(goal_id),
            self.keys.global_events(),
        ]

    async def request(
        self,
        goal_id: str,
        call_id: str,
        task_id: str,
        attempt: int,
        tool: str,
        arguments: dict[str, Any],
        event: Event,
        earlier: Sequence[EarlierCall] = (),
    ) -> bool:
        """Record that a call awaits approval, put it in the inbox and emit `event`. False if already there."""
        # json.dumps(default=str): a tool input the model sent is plain JSON already.
        now = time.time()
        request = ApprovalRequest(
            task_id=task_id, attempt=attempt, tool=tool, input=arguments, at=now, earlier=list(earlier)
        )
        body = json.dumps(request.model_dump(mode="json"), default=str)
        # The inbox's score, in milliseconds, keeps the clock's sub-millisecond part (a double holds
        # it to 0.3 µs): whole milliseconds made two requests a few µs apart tie, and a tie is
        # ordered by the member (a random goal id), so "oldest first" was a coin toss.
        score = repr(now * 1000)
        out = await self._request(
            keys=self._keys(goal_id),
            args=[call_id, body, member(goal_id, call_id), score, ev.encode(event), self.maxlen],
        )
        return bool(out)

    async def earlier_calls(self, goal_id: str, task_id: str, attempt: int, tool: str) -> list[EarlierCall]:
        """The task's stored calls of `tool` in attempts 1..`attempt` (that one's completed steps too),
        oldest first, each with how it ended: what a new request carries. Read from the attempts'
        steps, only when a request is made (rare)."""
        found: list[EarlierCall] = []
        for n in range(1, attempt + 1):
            for step in await AttemptStore(self.redis, self.keys, goal_id, task_id, n).steps():
                outcomes = {o.call_id: o for o in step.outcomes}
                for block in step.assistant.content:
                    if not isinstance(block, ToolUseBlock) or block.name != tool or block.id not in outcomes:
                        continue
                    o = outcomes[block.id]
                    cut = o.full if len(o.full) <= EARLIER_RESULT_LIMIT else o.full[:EARLIER_RESULT_LIMIT] + " [...]"
                    found.append(
                        EarlierCall(attempt=n, call_id=block.id, input=block.input, outcome=o.outcome, result=cut)
                    )
        return found

    async def decision(self, goal_id: str, call_id: str) -> ApprovalDecision | None:
        """The call's decision, None if undecided."""
        raw = await self.redis.hget(self.keys.approvals(goal_id), call_id)  # type: ignore[misc]
        return None if raw is None else ApprovalDecision.decode(as_str(raw))

    async def requests(self, goal_id: str) -> dict[str, ApprovalRequest]:
        """The goal's calls awaiting a decision, by call id."""
        key = self.keys.approval_requests(goal_id)
        raw = await self.redis.hgetall(key)  # type: ignore[misc]
        try:
            return {as_str(k): ApprovalRequest.model_validate_json(v) for k, v in raw.items()}
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ev.CorruptRecord("approval request", key, ev.first_error(exc)) from None

    async def waiting_tasks(self, goal_id: str) -> set[str]:
        """Ids of the goal's tasks with a call awaiting a decision (an unreadable request is skipped:
        it can never be decided, so nothing waits on it)."""
        raw = await self.redis.hgetall(self.keys.approval_requests(goal_id))  # type: ignore[misc]
        waiting: set[str] = set()
        for value in raw.values():
            try:
                waiting.add(str(json.loads(value)["task_id"]))
            except (ValueError, KeyError, TypeError):
                continue
        return waiting

    async def decide(self, goal_id: str, call_id: str, decision: ApprovalDecision, event: Event) -> str:
        """Store the decision, take the call out of the inbox and emit `event`, in one step.

        Returns `ok`, `decided` (the first decision stands; nothing written) or `missing`.
        """
        out = await self._decide(
            keys=self._keys(goal_id),
            args=[call_id, decision.encode(), member(goal_id, call_id), ev.encode(event), self.maxlen],
        )
        return as_str(out)

    async def pending(self, limit: int = 100, goal_id: str | None = None) -> list[PendingApproval]:
        """Calls awaiting a decision across every goal (or one), oldest first.

        Entries whose goal has ended (a cancelled goal's calls will never run) or whose request is
        gone are dropped from the inbox as they are found: such an entry can never become pending
        again, because a call id is decided once and a goal never leaves a terminal state.
        """
        rows = await self.redis.zrange(self.keys.approvals_pending(), 0, -1, withscores=True)
        entries = [(as_str(m), score) for m, score in rows]
        if goal_id is not None:
            entries = [(m, s) for m, s in entries if m.split(" ", 1)[0] == goal_id]
        out: list[PendingApproval] = []
        stale: list[str] = []
        for start in range(0, len(entries), 200):
            chunk = entries[start : start + 200]
            async with self.redis.pipeline(transaction=False) as pipe:
                for m, _ in chunk:
                    gid, _, cid = m.partition(" ")
                    pipe.hget(self.keys.approval_requests(gid), cid)
                    pipe.hget(self.keys.goal(gid), "state")
                replies = await pipe.execute()
            for i, (m, score) in enumerate(chunk):
                raw, state = replies[2 * i], replies[2 * i + 1]
                if raw is None or state is None or GoalState(as_str(state)) in GOAL_TERMINAL:
                    stale.append(m)
                    continue
                if len(out) >= limit:
                    continue
                gid, _, cid = m.partition(" ")
                body = json.loads(raw)
                out.append(
                    PendingApproval(
                        goal_id=gid,
                        call_id=cid,
                        task_id=body["task_id"],
                        attempt=int(body["attempt"]),
                        tool=body["tool"],
                        arguments=body.get("input") or {},
                        requested_at=float(body.get("at") or score / 1000),
                        earlier=body.get("earlier") or [],
                    )
                )
        if stale:
            await self.redis.zrem(self.keys.approvals_pending(), *stale)
        return out
