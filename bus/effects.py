"""The side-effect ledger: each side-effecting tool call of a goal's task, once, across attempts.

A task may run several attempts (a provider blip, a critic's retry, a resume, a replan that keeps
the task). A `side_effects` tool called again with the same arguments in a later attempt must not
act twice: the first call that starts claims `tool + arguments` for the task; a later call finds the
record and gets its outcome instead of running (unless the tool is declared idempotent).

Layout: one hash per goal task (`Keys.side_effects`): field `<key>` holds the record as JSON and
`state:<key>` its state (`started`, `ok`, `failed`, `unknown`), so that the claim script decides
on the state without parsing JSON. A `failed` call (the tool itself reported an error, so nothing
was done) may be claimed again; `started` (its worker died mid-call), `unknown` (a timeout or a
cancellation mid-call) and `ok` may not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from .durability import confirmed, script_confirmed
from .keys import Keys
from .replies import as_str
from .schemas import utcnow
from .scripts import lua, registered

EffectState = Literal["started", "ok", "failed", "unknown"]

RESULT_LIMIT = 4000  # characters of a call's result kept for later attempts


class EffectRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str  # `tool:args digest`
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    attempt: int = Field(ge=1)
    call_id: str
    state: EffectState = "started"
    result: str = ""  # what the tool returned (or its error), cut to RESULT_LIMIT
    at: str = Field(default_factory=lambda: utcnow().isoformat())


class SideEffects:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._begin = registered(redis, lua("effects_begin"))  # bus/lua/effects_begin.lua

    async def begin(self, goal_id: str, task_id: str, record: EffectRecord) -> EffectRecord | None:
        """Claim this call for `record.attempt`; None when claimed, else the earlier call's record."""
        key = self.keys.side_effects(goal_id, task_id)
        # Replicated before the tool runs (`bus.durability`): a start lost in a failover would let a
        # later attempt run the side effect again.
        out = await script_confirmed(
            self.redis, "side effect start", self._begin, [key], [record.key, record.model_dump_json()]
        )
        return None if not out else EffectRecord.model_validate_json(out)

    async def recorded(self, goal_id: str, task_id: str, key: str) -> EffectRecord | None:
        """The record of the call `key` (`tool:args digest`) of this task, None if it was never claimed.
        A read only: the claim itself is `begin`, made once the call is cleared to run."""
        raw, state = await self.redis.hmget(self.keys.side_effects(goal_id, task_id), [key, f"state:{key}"])  # type: ignore[misc]
        if raw is None:
            return None
        record = EffectRecord.model_validate_json(raw)
        st = state.decode() if isinstance(state, bytes) else state
        return record.model_copy(update={"state": st}) if st and st != record.state else record

    async def finish(self, goal_id: str, task_id: str, record: EffectRecord) -> None:
        """Store how the call ended (also used for idempotent tools, which never claim)."""
        key = self.keys.side_effects(goal_id, task_id)
        mapping = {record.key: record.model_dump_json(), f"state:{record.key}": record.state}

        def queue(pipe: Pipeline) -> None:
            pipe.hset(key, mapping=mapping)

        reply = await confirmed(self.redis, "side effect outcome", queue)
        if isinstance(reply, Exception):
            raise reply

    async def history(self, goal_id: str, task_id: str) -> list[EffectRecord]:
        """Every side-effecting call the task's attempts made, oldest first."""
        raw = await self.redis.hgetall(self.keys.side_effects(goal_id, task_id))  # type: ignore[misc]
        records = []
        for field, value in raw.items():
            name = as_str(field)
            if not name.startswith("state:"):
                records.append(EffectRecord.model_validate_json(value))
        return sorted(records, key=lambda r: (r.at, r.attempt))
