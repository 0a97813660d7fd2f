"""Liveness and readiness."""

import sqlalchemy as sa
from fastapi import APIRouter

from service.api.deps import SessionDep, SettingsDep
from service.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(session: SessionDep, settings: SettingsDep) -> Health:
    await session.execute(sa.text("SELECT 1"))
    return Health(status="ok", database=session.bind.dialect.name, local_mode=settings.local_mode)
