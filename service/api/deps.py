"""Request dependencies: settings, database session, API token."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from service.config import Settings


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessions() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
EngineDep = Annotated[AsyncEngine, Depends(get_engine)]
SessionDep = Annotated[AsyncSession, Depends(get_session)]


def has_token(request: Request, settings: SettingsDep) -> bool:
    """True when the caller may see and change everything (always, in local mode)."""
    if settings.api_token is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(
        token.strip().encode(), settings.api_token.encode()
    )


def require_token(authorized: Annotated[bool, Depends(has_token)]) -> None:
    if not authorized:
        raise HTTPException(
            status_code=401,
            detail="missing or wrong API token: send 'Authorization: Bearer <SWERVE_API_TOKEN>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


TOKEN_REQUIRED = [Depends(require_token)]
