"""Database URL resolution and async engine creation."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from inferscale.core.settings import Settings, get_settings


def resolve_database_url(settings: Settings | None = None) -> str:
    """The configured database URL, else the running embedded Postgres (error if none)."""
    settings = settings or get_settings()
    if settings.database_url:
        return settings.database_url
    from inferscale.core.endpoints import embedded_database_url

    return embedded_database_url(settings)


def create_engine(url: str | None = None, settings: Settings | None = None) -> AsyncEngine:
    """An asyncpg-backed SQLAlchemy engine for the InferScale database."""
    return create_async_engine(
        url or resolve_database_url(settings), pool_size=5, max_overflow=5, pool_pre_ping=True)
