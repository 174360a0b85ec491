"""Goals: submit, list, read (state, plan, ledger, attempts) and cancel."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Header, Query, Request, Response
from opentelemetry.trace import SpanKind

import bus.tracing as tracing
from bus.client import Client
from bus.goal_index import BadCursor
from bus.ledger import LedgerNotFound, LedgerSnapshot
from bus.schemas import GOAL_ID_PATTERN, GoalState
from bus.store import AlreadyExists, IllegalTransition, NotFound
from planner.dag import render_json, render_mermaid

from .. import models as m
from ..deps import BODY_ERRORS, ClientDep, Config, GoalIdPath, IndexDep, JsonBody, Reader, Submitter, goal_id_of
from ..errors import ApiError

log = structlog.get_logger("taskloom.api")

router = APIRouter(tags=["goals"])
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": m.ErrorBody}}


@router.post(
    "/v1/goals",
    response_model=m.Submitted,
    status_code=201,
    responses={
        200: {"model": m.Submitted, "description": "already submitted under this Idempotency-Key"},
        409: {"model": m.ErrorBody, "description": "the Idempotency-Key was used for another goal"},
        **BODY_ERRORS,
    },
)
async def submit(
    goal: m.GoalIn,
    who: Submitter,
    _: JsonBody,
    request: Request,
    response: Response,
    c: ClientDep,
    config: Config,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="your id for this goal (letters, digits, _ and -, up to 64): "
            "re-sending the same request stores nothing new and returns the same goal id",
        ),
    ] = None,
) -> m.Submitted:
    """Submit a goal; it is planned and run by the workers."""
    aliases = config.model_aliases
    if goal.model is not None and aliases is not None and goal.model not in aliases:
        known = ", ".join(sorted(aliases)) or "none (no models file)"
        raise ApiError(422, "invalid_request", f"model: {goal.model!r} is no configured alias ({known})", "model")
    if idempotency_key is not None and not re.match(GOAL_ID_PATTERN, idempotency_key):
        raise ApiError(
            422, "invalid_request", "Idempotency-Key: use 1 to 64 letters, digits, _ or -", "Idempotency-Key"
        )
    try:
        # A caller's W3C `traceparent` header: the goal joins the caller's trace (bus.tracing).
        with tracing.span("POST /v1/goals", kind=SpanKind.SERVER, parent=request.headers.get("traceparent")):
            # The store's atomic create decides `created`: of concurrent requests with one key, one wins.
            gid, created = await c.submit_once(goal.to_goal(), goal_id=idempotency_key)
    except AlreadyExists:
        raise ApiError(
            409,
            "conflict",
            f"Idempotency-Key {idempotency_key!r} was already used for a different goal",
            "Idempotency-Key",
        ) from None
    log.info("api.submitted", goal_id=gid, by=who.name, replay=not created)
    if not created:
        response.status_code = 200
    return m.Submitted(goal_id=gid, created=created)


@router.get("/v1/goals", response_model=m.GoalList)
async def list_goals(
    _: Reader,
    c: ClientDep,
    index: IndexDep,
    config: Config,
    state_: Annotated[
        list[GoalState] | None, Query(alias="state", description="repeatable: any of these states")
    ] = None,
    cursor: Annotated[str | None, Query(max_length=200, description="from the previous page's next_cursor")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> m.GoalList:
    """Goals, newest first, optionally filtered by state; page with `cursor`."""
    try:
        page = await index.page(state_, cursor, limit, config.scan_limit)
    except BadCursor as exc:
        raise ApiError(422, "invalid_request", str(exc), "cursor") from None
    rows = await asyncio.gather(*(_summary(c, gid) for gid in page.ids))
    return m.GoalList(goals=[r for r in rows if r is not None], next_cursor=page.next_cursor)


@router.get("/v1/goals/{goal_id}", response_model=m.GoalStatusOut, responses=NOT_FOUND)
async def goal_status(goal_id: GoalIdPath, _: Reader, c: ClientDep) -> m.GoalStatusOut:
    """A goal's state, answer, current plan and every task's state."""
    s = await c.status(goal_id_of(goal_id))
    return m.GoalStatusOut(goal=s.goal, plan=s.plan, tasks=s.tasks)


@router.get("/v1/goals/{goal_id}/plan", response_model=m.PlanOut, responses=NOT_FOUND)
async def goal_plan(
    goal_id: GoalIdPath,
    _: Reader,
    c: ClientDep,
    version: Annotated[int | None, Query(ge=1, description="default: current")] = None,
) -> m.PlanOut:
    """The DAG of the current (or a given) plan version, with each task's state, in JSON and Mermaid."""
    await c.get(goal_id_of(goal_id))
    stored = await c.store.get_plan(goal_id, version)
    states = {tid: t.state for tid, t in (await c.store.get_tasks(goal_id)).items()}
    return m.PlanOut.model_validate(
        {
            "goal_id": goal_id,
            "version": stored.version,
            "reason": stored.reason,
            **render_json(stored.plan, states),
            "mermaid": render_mermaid(stored.plan, states),
        }
    )


@router.get("/v1/goals/{goal_id}/ledger", response_model=LedgerSnapshot, responses=NOT_FOUND)
async def goal_ledger(goal_id: GoalIdPath, _: Reader, c: ClientDep) -> LedgerSnapshot:
    """The goal's token budget: spent by kind, reserved, calls, cost and headroom."""
    await c.get(goal_id_of(goal_id))
    try:
        return await c.ledger.snapshot(goal_id)
    except LedgerNotFound:
        raise ApiError(404, "not_found", f"goal {goal_id!r} has no ledger") from None


@router.get("/v1/goals/{goal_id}/attempts", response_model=m.AttemptsOut, responses=NOT_FOUND)
async def goal_attempts(goal_id: GoalIdPath, _: Reader, c: ClientDep) -> m.AttemptsOut:
    """Each task's attempts: the answer, how it stopped, its usage and the critic's verdict."""
    return await _attempts(c, goal_id_of(goal_id))


@router.post(
    "/v1/goals/{goal_id}/cancel",
    response_model=m.Cancelled,
    responses={
        **NOT_FOUND,
        409: {"model": m.ErrorBody, "description": "the goal already ended (cancelled included)"},
        **BODY_ERRORS,
    },
)
async def cancel(
    goal_id: GoalIdPath, who: Submitter, _: JsonBody, c: ClientDep, body: m.CancelIn | None = None
) -> m.Cancelled:
    """Cancel a goal and its unfinished tasks; a goal that already ended, cancelled included, is a 409."""
    reason = (body or m.CancelIn()).reason
    try:
        changed = await c.cancel(goal_id_of(goal_id), f"{reason} (by {who.name})")
    except IllegalTransition as exc:
        changed, ended = False, exc.current
    else:
        ended = GoalState.CANCELLED.value
    if not changed:
        # One rule for every ended goal, cancelled included: whoever cancelled first got the 200.
        raise ApiError(409, "conflict", f"goal {goal_id} already ended ({ended}); nothing to cancel")
    log.info("api.cancelled", goal_id=goal_id, by=who.name)
    return m.Cancelled(goal_id=goal_id, changed=True)


async def _summary(c: Client, goal_id: str) -> m.GoalSummary | None:
    try:
        goal = await c.get(goal_id)
    except NotFound:
        return None  # deleted between the index read and now
    tasks = await c.store.get_tasks(goal_id)
    current = [t for t in tasks.values() if t.state.value != "superseded"]  # dropped by a replan
    try:
        books = await c.ledger.snapshot(goal_id)
        spent, reserved = books.spent, books.reserved
    except LedgerNotFound:
        spent = reserved = 0
    return m.GoalSummary(
        id=goal.id,
        text=goal.goal.text,
        state=goal.state,
        plan_version=goal.plan_version,
        tasks_total=len(current),
        tasks_done=sum(1 for t in current if t.state.value == "done"),
        budget_tokens=goal.budget_tokens,
        spent_tokens=spent,
        reserved_tokens=reserved,
        created_at=goal.created_at,
        updated_at=goal.updated_at,
        reason=goal.reason,
    )


async def _attempts(c: Client, goal_id: str) -> m.AttemptsOut:
    goal = await c.get(goal_id)
    tasks = await c.store.get_tasks(goal_id)
    titles: dict[str, str] = {}
    if goal.plan_version:
        for v in range(1, goal.plan_version + 1):
            with contextlib.suppress(NotFound):
                titles.update({t.id: t.title for t in (await c.store.get_plan(goal_id, v)).plan.tasks})
    results = await c.store.all_results(goal_id)
    verdicts: dict[tuple[str, int], m.Verdict] = {}
    for e in await c.log.read(goal_id, count=100_000):
        if e.type == "critic.verdict" and e.task_id and "attempt" in e.data:
            verdicts[(e.task_id, int(e.data["attempt"]))] = m.Verdict(
                passed=bool(e.data.get("passed")),
                action=str(e.data.get("action", "")),
                feedback=str(e.data.get("feedback", "")),
            )
    out = []
    for tid, t in tasks.items():
        mine = sorted((r for r in results if r.task_id == tid), key=lambda r: r.attempt)
        out.append(
            m.TaskAttempts(
                task_id=tid,
                title=titles.get(tid, tid),
                state=t.state.value,
                attempt=t.attempt,
                feedback=t.feedback,
                attempts=[
                    m.AttemptOut(
                        attempt=r.attempt,
                        answer=r.answer,
                        stop_reason=r.stop_reason,
                        steps=r.steps,
                        tool_calls=r.tool_calls,
                        usage=r.usage,
                        created_at=r.created_at,
                        verdict=verdicts.get((tid, r.attempt)),
                    )
                    for r in mine
                ],
            )
        )
    return m.AttemptsOut(goal_id=goal_id, tasks=out)
