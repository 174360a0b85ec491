"""Tool calls waiting for a person: the inbox, and the decision."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Annotated, Literal

import structlog
from fastapi import APIRouter, Path, Query

from bus.store import NotFound

from .. import models as m
from ..deps import BODY_ERRORS, Approver, ClientDep, GoalIdPath, JsonBody, Reader, goal_id_of
from ..errors import ApiError

log = structlog.get_logger("taskloom.api")

router = APIRouter(tags=["approvals"])


@router.get("/v1/approvals", response_model=m.ApprovalList)
async def approvals(
    _: Reader,
    c: ClientDep,
    goal_id: Annotated[str | None, Query(max_length=64, description="only this goal's")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> m.ApprovalList:
    """Tool calls waiting for a decision across every running goal, oldest first."""
    pending = await c.pending_approvals(limit, goal_id)
    out = []
    for p in pending:
        with contextlib.suppress(NotFound):
            goal = await c.get(p.goal_id)
            title = None
            if goal.plan_version:
                with contextlib.suppress(NotFound):
                    plan = await c.store.get_plan(p.goal_id)
                    title = next((t.title for t in plan.plan.tasks if t.id == p.task_id), None)
            out.append(
                m.ApprovalOut(
                    goal_id=p.goal_id,
                    goal_text=goal.goal.text,
                    task_id=p.task_id,
                    task_title=title,
                    attempt=p.attempt,
                    call_id=p.call_id,
                    tool=p.tool,
                    arguments=p.arguments,
                    requested_at=datetime.fromtimestamp(p.requested_at, UTC),
                    earlier=p.earlier,
                )
            )
    return m.ApprovalList(approvals=out)


@router.post(
    "/v1/approvals/{goal_id}/{call_id}/{decision}",
    response_model=m.Decided,
    responses={
        404: {"model": m.ErrorBody},
        409: {"model": m.ErrorBody, "description": "already decided"},
        **BODY_ERRORS,
    },
)
async def decide(
    goal_id: GoalIdPath,
    call_id: Annotated[str, Path(max_length=200)],
    decision: Annotated[Literal["approve", "deny"], Path(description="approve or deny the call")],
    who: Approver,
    _: JsonBody,
    c: ClientDep,
    body: m.DecisionIn | None = None,
) -> m.Decided:
    """Approve a tool call (its task resumes and runs it) or deny it (the model is told, with the
    reason). Your token's name is recorded."""
    approved = decision == "approve"
    reason = (body or m.DecisionIn()).reason
    if not approved and not reason:
        reason = f"denied by {who.name}"
    first = await c.decide(goal_id_of(goal_id), call_id, approved, reason, by=who.name)
    if not first:
        raise ApiError(409, "conflict", f"tool call {goal_id}/{call_id} was already decided")
    log.info("api.decided", goal_id=goal_id, call_id=call_id, approved=approved, by=who.name)
    return m.Decided(goal_id=goal_id, call_id=call_id, approved=approved, by=who.name)
