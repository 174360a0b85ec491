"""Tenants: a tenant's pool, running tasks and spend."""

from __future__ import annotations

from fastapi import APIRouter

from bus.tenants import TenantView

from .. import models as m
from ..deps import ClientDep, Reader
from ..errors import ApiError

router = APIRouter(tags=["tenants"])


@router.get("/v1/tenants/{name}", response_model=TenantView, responses={422: {"model": m.ErrorBody}})
async def tenant(name: str, _: Reader, c: ClientDep) -> TenantView:
    """A tenant's pool settings, running tasks and spend by period, model and kind (bus.tenants)."""
    try:
        return await c.tenant_show(name)
    except ValueError as exc:
        raise ApiError(422, "invalid_request", str(exc), "name") from None
