"""Database URL resolution and async engine creation."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from inferscale.settings import Settings, get_settings


def resolve_database_url(settings: Settings | None = None) -> str:
    """The configured database URL, else the running embedded Postgres (error if none)."""
    settings = settings or get_settings()
    if settings.database_url:
        return settings.database_url
    from inferscale.infra import embedded_database_url

    return embedded_database_url(settings)


def create_engine(url: str | None = None, settings: Settings | None = None) -> AsyncEngine:
    """An asyncpg-backed SQLAlchemy engine for the InferScale database. Its sessions let an
    HNSW scan go on until enough rows pass a filter (an owner's facts), set once per connection,
    not per query. The scan may return them slightly out of order (``relaxed_order``: faster and
    with better recall than ``strict_order``); ``top_k_facts`` sorts its k rows."""
    return create_async_engine(
        url or resolve_database_url(settings), pool_size=5, max_overflow=5, pool_pre_ping=True,
        connect_args={"server_settings": {"hnsw.iterative_scan": "relaxed_order"}},
    )
