"""Planner job handlers. Each is safe to run twice: arq delivers at least once.

The planning logic itself (model call, DAG validation, dispatch) arrives with the planner issue;
here the goal is claimed for planning, which is what a re-delivered or reconciled job must see.
"""

from __future__ import annotations

import structlog

from bus.jobs import AdvanceJob, PlanJob, ReplanJob
from bus.runtime import Runtime
from bus.schemas import GoalState

log = structlog.get_logger("taskloom.planner")


async def plan(rt: Runtime, job: PlanJob) -> None:
    goal = await rt.store.get_goal(job.goal_id)
    if goal.state != GoalState.SUBMITTED and goal.state != GoalState.PLANNING:
        log.info("plan.skipped", state=goal.state.value)  # cancelled, or a duplicate delivery
        return
    moved = await rt.store.transition_goal(job.goal_id, GoalState.PLANNING)
    log.info("plan.claimed" if moved else "plan.resumed")


async def advance(rt: Runtime, job: AdvanceJob) -> None:
    log.info("advance.received")


async def replan(rt: Runtime, job: ReplanJob) -> None:
    log.info("replan.received", reason=job.reason)
