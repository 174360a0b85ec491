"""Critic job handlers (reviews arrive with the critic issue)."""

from __future__ import annotations

import structlog

from bus.jobs import ReviewGoalJob, ReviewJob
from bus.runtime import Runtime

log = structlog.get_logger("taskloom.critic")


async def review(rt: Runtime, job: ReviewJob) -> None:
    log.info("review.received")


async def review_goal(rt: Runtime, job: ReviewGoalJob) -> None:
    log.info("review_goal.received")
