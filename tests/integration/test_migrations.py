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


async def _fetch(url: str, sql: str) -> list:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql)
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
        await _execute(raw, "TRUNCATE facts CASCADE")  # a reset: every owner's version moves
        assert await _fetchval(raw, version) > backfilled
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()


FACT = ("INSERT INTO facts (id, user_id, conversation_id, turn_ids, extractor, text, ts, "
        "embedding{columns}) VALUES ({id}, 'ana', 'c', '{{t{id}}}', 'turn', 'x', now(), "
        "array_fill(0.1, ARRAY[384])::vector{values})")


async def test_kv_per_model_keeps_each_facts_kv_and_queue_state(base_settings):
    """0012 moves a fact's KV columns to its row for the model they were made for, registers
    every such model, keeps a never-encoded fact's queue state for each, and enrols every live
    fact for every model; new facts get a row per registered model. Its downgrade keeps each
    fact's most recently encoded model's KV."""
    url = make_url(base_settings.database_url)
    plain = url.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"migrations_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(plain)
    await admin.execute(f'CREATE DATABASE "{name}"')
    a, b = "a" * 64, "b" * 64
    try:
        target = url.set(database=name).render_as_string(hide_password=False)
        raw = make_url(target).set(drivername="postgresql").render_as_string(hide_password=False)
        await asyncio.to_thread(migrate.upgrade, target, "0011")
        kv = ", model_fingerprint, kv_location, kv_checksum, kv_bytes, token_ids, encoded_at"
        await _execute(raw, FACT.format(id=1, columns=kv,
                                        values=f", '{a}', 'a/1', 'c1', 10, '{{1,2}}', now()"))
        await _execute(raw, FACT.format(  # evicted
            id=2, columns=", model_fingerprint, kv_evicted_at, encoded_at",
            values=f", '{a}', now(), now()"))
        await _execute(raw, FACT.format(  # never encoded, tried twice
            id=3, columns=", encode_attempts, encode_claims, encode_error",
            values=", 2, 2, 'encode: boom'"))
        await _execute(raw, FACT.format(id=4, columns=kv,
                                        values=f", '{b}', 'b/4', 'c4', 20, '{{4}}', now()"))
        await asyncio.to_thread(migrate.upgrade, target)
        rows = {(r["model_fingerprint"], r["fact_id"]): r for r in await _fetch(
            raw, "SELECT * FROM fact_kv")}
        assert set(rows) == {(m, f) for m in (a, b) for f in (1, 2, 3, 4)}
        assert (rows[a, 1]["kv_location"], rows[a, 1]["kv_bytes"], rows[a, 1]["token_ids"],
                rows[a, 1]["enrolled"]) == ("a/1", 10, [1, 2], False)
        assert rows[a, 2]["kv_evicted_at"] is not None and rows[a, 2]["kv_location"] is None
        assert all((rows[m, 3]["encode_attempts"], rows[m, 3]["encode_error"],
                    rows[m, 3]["enrolled"]) == (2, "encode: boom", False) for m in (a, b))
        assert rows[b, 4]["kv_location"] == "b/4" and rows[a, 4]["kv_location"] is None
        assert rows[a, 4]["enrolled"] and rows[b, 1]["enrolled"] and rows[b, 2]["enrolled"]
        await _execute(raw, FACT.format(id=5, columns="", values=""))
        assert await _fetchval(raw, "SELECT array_agg(model_fingerprint ORDER BY "
                                    "model_fingerprint) FROM fact_kv WHERE fact_id = 5") == [a, b]
        await asyncio.to_thread(migrate.downgrade, target, "0011")
        facts = {r["id"]: r for r in await _fetch(raw, "SELECT * FROM facts")}
        assert (facts[1]["model_fingerprint"], facts[1]["kv_location"]) == (a, "a/1")
        assert (facts[4]["model_fingerprint"], facts[4]["kv_location"]) == (b, "b/4")
        assert facts[3]["model_fingerprint"] is None and facts[3]["encode_attempts"] == 2
        assert facts[5]["model_fingerprint"] is None and facts[5]["kv_location"] is None
        await asyncio.to_thread(migrate.upgrade, target)
        assert await _fetchval(raw, "SELECT count(*) FROM fact_kv WHERE kv_location IS NOT "
                                    "NULL") == 2
    finally:
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        await admin.close()
