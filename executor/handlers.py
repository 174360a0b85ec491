"""Executor job handlers (the ReAct loop arrives with the executor issue)."""

from __future__ import annotations

import structlog

from bus.jobs import ExecuteJob
from bus.runtime import Runtime

log = structlog.get_logger("taskloom.executor")


async def execute(rt: Runtime, job: ExecuteJob) -> None:
    log.info("execute.received")
