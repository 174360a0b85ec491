"""How the store's Redis values become records, and its scripts' replies outcomes (pure: no I/O).

Every parser names the key it read in the `CorruptRecord` it raises for a value that does not parse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from .replies import as_str
from .schemas import GoalRecord, StoredPlan, TaskProgress, TaskRecord, TaskResult, TaskState
from .store_errors import IllegalTransition, NotFound, StaleWrite, corrupt


def csv(states: Any) -> str:
    """States as the scripts take them: sorted, comma-separated."""
    return ",".join(sorted(str(s) for s in states))


def goal_from_hash(key: str, goal_id: str, raw: dict[Any, Any]) -> GoalRecord:
    """The goal hash at `key` as a record: its immutable core (`record`, JSON) and its live fields."""
    if not raw:
        raise NotFound("goal", goal_id)
    h = {as_str(k): as_str(v) for k, v in raw.items()}
    try:
        core = json.loads(h["record"])
        return GoalRecord.model_validate(
            {
                **core,
                "state": h["state"],
                "plan_version": int(h.get("plan_version", 0)),
                "replans": int(h.get("replans", 0)),
                "resumes": int(h.get("resumes", 0)),
                "budget_tokens": int(h.get("budget_tokens") or core["budget_tokens"]),
                "answer": h.get("answer"),
                "reason": h.get("reason"),
                "updated_at": h.get("updated_at") or core["created_at"],
            }
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise corrupt("goal", key, exc) from None


def task_from_hash(key: str, goal_id: str, task_id: str, raw: dict[Any, Any]) -> TaskRecord:
    """A task hash (not empty) at `key` as a record."""
    h = {as_str(k): as_str(v) for k, v in raw.items()}
    try:
        return TaskRecord.model_validate(
            {
                "goal_id": goal_id,
                "task_id": task_id,
                "state": h["state"],
                "attempt": int(h.get("attempt", 0)),
                "first_attempt": int(h.get("first_attempt", 1)),
                "plan_version": int(h.get("plan_version", 1)),
                "reason": h.get("reason"),
                "feedback": h.get("feedback"),
                "updated_at": h["updated_at"],
            }
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise corrupt("task", key, exc) from None


_PROGRESS_ERROR = re.compile(r"task record (\d+): (.*)", re.S)


def progress_from_reply(keys: Sequence[str], ids: Sequence[str], reply: Any) -> dict[str, TaskProgress]:
    """The reply of store_progress.lua for the task hashes `keys` (of tasks `ids`, in order) as each
    task's progress; a task without a record is left out. Raises `CorruptRecord` naming the key
    whose hash is not a task's (no hash, no state, a state or attempt that does not parse)."""
    if isinstance(reply, ResponseError):
        m = _PROGRESS_ERROR.search(str(reply))
        if m is None or not 1 <= int(m.group(1)) <= len(keys):
            raise corrupt("task", ", ".join(keys), reply)
        raise corrupt("task", keys[int(m.group(1)) - 1], ResponseError(m.group(2)))
    if not isinstance(reply, list) or len(reply) != 2 * len(keys):
        raise corrupt("task", ", ".join(keys), ValueError(f"unexpected reply {reply!r:.200}"))
    out: dict[str, TaskProgress] = {}
    for i, tid in enumerate(ids):
        state, attempt = reply[2 * i], reply[2 * i + 1]
        if state is None:
            continue
        try:
            n = int(as_str(attempt)) if attempt is not None else 0
            if n < 0:
                raise ValueError(f"attempt {n} is negative")
            out[tid] = TaskProgress(TaskState(as_str(state)), n)
        except ValueError as exc:
            raise corrupt("task", keys[i], exc) from None
    return out


def plan_from_json(key: str, raw: bytes | str) -> StoredPlan:
    try:
        return StoredPlan.model_validate_json(raw)
    except ValueError as exc:
        raise corrupt("plan", key, exc) from None


def result_from_json(key: str, field: str, raw: bytes | str) -> TaskResult:
    """A result as read from `field` (`task_id:attempt`) of the results hash at `key`."""
    try:
        return TaskResult.model_validate_json(raw)
    except ValueError as exc:
        raise corrupt(f"result {field}", key, exc) from None


def transition_outcome(out: list[Any], entity: str, target: str, expected_attempt: int | None = None) -> bool:
    """The transition script's reply: True moved, False already there; else the error it means."""
    tag = as_str(out[0])
    if tag == "ok":
        return True
    if tag == "same":
        return False
    if tag == "missing":
        kind, _, ident = entity.partition(" ")
        raise NotFound(kind, ident)
    if tag == "stale":
        raise StaleWrite(entity, f"attempt {expected_attempt}", f"attempt {as_str(out[1])}")
    raise IllegalTransition(entity, as_str(out[1]), target)
