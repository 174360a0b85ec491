"""Approvals of tool calls: the request an executor leaves for a person, and the person's decision.

Both are typed records owned here; the Redis layout is (keys from `bus.keys`):
* `approval_requests(goal)` hash: tool call id -> `ApprovalRequest` JSON, deleted once decided;
* `approvals(goal)` hash: tool call id -> the decision, `approved` or `denied:<reason>` (the stored
  form since wave 1; `ApprovalDecision.encode/decode` are the only code that reads or writes it).

The first decision wins (HSETNX), so two people deciding at once cannot both resume the task.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from redis.asyncio import Redis

from .events import CorruptRecord, first_error
from .keys import Keys

_APPROVED = "approved"
_DENIED = "denied:"


class ApprovalRequest(BaseModel):
    """A tool call waiting for a person: which task attempt asked, with which tool and input."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    attempt: int
    tool: str
    input: dict[str, Any]


class ApprovalDecision(BaseModel):
    """A person's answer to one request; a denial's reason reaches the model."""

    model_config = ConfigDict(frozen=True)

    approved: bool
    reason: str = ""

    def encode(self) -> str:
        return _APPROVED if self.approved else f"{_DENIED}{self.reason}"

    @classmethod
    def decode(cls, raw: str) -> ApprovalDecision:
        if raw == _APPROVED:
            return cls(approved=True)
        return cls(approved=False, reason=raw.removeprefix(_DENIED))


# KEYS: approvals, approval requests. ARGV: call id, encoded decision. Returns 1, or 0 if decided before.
_DECIDE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class ApprovalBook:
    """The approval requests and decisions of every goal under one key prefix."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._decide = redis.register_script(_DECIDE)

    async def request(self, goal_id: str, call_id: str, request: ApprovalRequest) -> None:
        # json.dumps(default=str) as in wave 1: a tool input the model sent is plain JSON already.
        body = json.dumps(request.model_dump(mode="json"), default=str)
        await self.redis.hset(self.keys.approval_requests(goal_id), call_id, body)  # type: ignore[misc]

    async def requests(self, goal_id: str) -> dict[str, ApprovalRequest]:
        """Open requests by call id; raises `CorruptRecord` naming the key if one cannot be read."""
        key = self.keys.approval_requests(goal_id)
        raw = await self.redis.hgetall(key)  # type: ignore[misc]
        try:
            return {_s(k): ApprovalRequest.model_validate_json(v) for k, v in raw.items()}
        except ValidationError as exc:
            raise CorruptRecord("approval request", key, first_error(exc)) from None

    async def decision(self, goal_id: str, call_id: str) -> ApprovalDecision | None:
        raw = await self.redis.hget(self.keys.approvals(goal_id), call_id)  # type: ignore[misc]
        return None if raw is None else ApprovalDecision.decode(_s(raw))

    async def decide(self, goal_id: str, call_id: str, decision: ApprovalDecision) -> bool:
        """Record the decision and close the request, in one step, unless a decision came first."""
        keys = [self.keys.approvals(goal_id), self.keys.approval_requests(goal_id)]
        return bool(await self._decide(keys=keys, args=[call_id, decision.encode()]))
