"""The fleet and this process: workers and queues, liveness, readiness, metrics, and the caller."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from enum import Enum

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bus.client import Client

from ... import health
from ...metrics import REGISTRY
from .. import models as m
from ..auth import SCOPES
from ..deps import Caller, ClientDep, Config, Reader

router = APIRouter()
OPERATIONS: list[str | Enum] = ["operations"]


@router.get("/v1/me", response_model=m.Me, tags=["auth"])
async def me(who: Caller) -> m.Me:
    """The calling token's name and scopes (the console shows buttons by them)."""
    return m.Me(name=who.name, scopes=sorted(who.scopes & set(SCOPES)))


@router.get("/healthz", response_model=m.Health, tags=OPERATIONS)
async def healthz() -> m.Health:
    """The process is up (liveness)."""
    return m.Health(ok=True)


@router.get("/readyz", response_model=m.Health, tags=OPERATIONS, responses={503: {"model": m.Health}})
async def readyz(c: ClientDep, config: Config) -> Response:
    """Redis answers (readiness), and with TASKLOOM_API_READY_REQUIRES_WORKERS every role has a live
    worker: 503 otherwise."""
    reasons: list[str] = []
    try:
        await asyncio.wait_for(c.ping(), 2)
        if config.ready_requires_workers:
            fleet = await asyncio.wait_for(_fleet(c), 2)
            reasons = [f"no live {r.role} worker" for r in fleet.roles if not r.live_workers]
    except Exception as exc:  # a probe answers; it never raises
        reasons = [f"cannot reach Redis: {exc!r}"]
    if reasons:
        return JSONResponse(m.Health(ok=False, reasons=reasons).model_dump(), status_code=503)
    return JSONResponse(m.Health(ok=True).model_dump())


@router.get("/v1/fleet", response_model=m.Fleet, tags=OPERATIONS)
async def fleet(_: Reader, c: ClientDep) -> m.Fleet:
    """Each role's live workers, queue depth and longest wait (what `taskloom health` reads);
    `ok` is false while any role has no live worker."""
    return await _fleet(c)


@router.get(
    "/metrics",
    response_class=Response,
    tags=OPERATIONS,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(_: Reader) -> Response:
    """Prometheus metrics of this process (the workers' registry, plus API request counts)."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def _fleet(c: Client) -> m.Fleet:
    roles = [
        m.FleetRole(
            role=r.role,  # one of bus.keys.ROLES
            live_workers=r.live_workers,
            queue_depth=r.queue_depth,
            oldest_queued_age_s=r.oldest_queued_age_s,
        )
        for r in await health.load(c.redis, c.keys)
    ]
    node = None
    with contextlib.suppress(Exception):  # INFO may be refused (a managed Redis): the roles still answer
        n = await health.node_of(c.redis)
        node = m.FleetRedis(
            address=n.address,
            role=n.role,
            via_sentinel=n.via_sentinel,
            used_memory=n.used_memory,
            maxmemory=n.maxmemory,
            memory_full=n.memory_full,
        )
    writable = node is None or (node.role == "master" and not node.memory_full)
    ok = all(r.live_workers for r in roles) and writable
    return m.Fleet(ok=ok, roles=roles, redis=node, checked_at=datetime.now(UTC))
