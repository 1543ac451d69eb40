"""Alembic migrations on the real Postgres: upgrade -> downgrade -> upgrade."""

import asyncio
import uuid

import asyncpg
from sqlalchemy.engine import make_url

from inferscale.db import migrate


async def _tables(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        return {r["tablename"] for r in rows}
    finally:
        await conn.close()


async def _hnsw_index(url: str) -> str | None:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_facts_embedding_hnsw'")
    finally:
        await conn.close()


async def _execute(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _fetchval(url: str, sql: str):
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def test_upgrade_downgrade_upgrade(base_settings):
    url = make_url(base_settings.database_url)
    plain = url.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"migrations_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(plain)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        target = url.set(database=name).render_as_string(hide_password=False)
        raw = make_url(target).set(drivername="postgresql").render_as_string(hide_password=False)
        await asyncio.to_thread(migrate.upgrade, target)
        assert {"turns", "facts", "alembic_version"} <= await _tables(raw)
        await asyncio.to_thread(migrate.downgrade, target, "base")
        assert await _tables(raw) == {"alembic_version"}
        await asyncio.to_thread(migrate.upgrade, target)
        tables = await _tables(raw)
        assert {"turns", "facts"} <= tables
        # 0007 drops the global HNSW index (exact search within one owner); its downgrade
        # brings it back.
        assert await _hnsw_index(raw) is None
        await asyncio.to_thread(migrate.downgrade, target, "0006")
        index = await _hnsw_index(raw)
        assert "hnsw" in index and "vector_cosine_ops" in index
        await asyncio.to_thread(migrate.upgrade, target)
        assert await _hnsw_index(raw) is None
        # 0008 gives every owner that has facts a memory version; its downgrade drops them.
        await asyncio.to_thread(migrate.downgrade, target, "0007")
        assert "memory_versions" not in await _tables(raw)
        await _execute(raw, "INSERT INTO facts (user_id, conversation_id, turn_ids, extractor, "
                            "text, ts, embedding) VALUES ('ana', 'c', '{t1}', 'turn', 'x', now(), "
                            "array_fill(0.1, ARRAY[384])::vector)")
        await asyncio.to_thread(migrate.upgrade, target)
        version = "SELECT version FROM memory_versions WHERE user_id = 'ana'"
        backfilled = await _fetchval(raw, version)
        assert backfilled > 0
        await _execute(raw, "TRUNCATE facts")  # a reset: every owner's version moves
        assert await _fetchval(raw, version) > backfilled
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()
