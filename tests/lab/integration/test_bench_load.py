"""``bench load``'s progress query on the real Postgres."""

import uuid
from dataclasses import replace
from datetime import UTC, datetime

from kvrows import set_kv
from sqlalchemy import select

from helpers import extract_all, ingest, turn
from inferscale.db.tables import facts
from inferscale.lab.bench.load import TURN_PROGRESS
from inferscale.pipeline.extraction import TurnExtractor

TS = datetime(2025, 5, 3, 9, 0, tzinfo=UTC)
MODEL = "f" * 64  # the model the facts are encoded for (as if)


async def test_bench_progress_counts_any_number_of_facts_per_turn(settings, engine, embedder):
    """`bench load` waits per turn: a turn is encoded once all its live facts have KV (a turn
    without facts, once extracted)."""
    prefix = f"progress-{uuid.uuid4().hex[:6]}"
    user = f"{prefix}-0"
    await ingest(settings, engine, [turn(user, "t1", "Kim", "Two facts."),
                                    turn(user, "t2", "Kim", "No facts.")])

    class TwoOrNone:
        name = "turn"

        def extract(self, turns_):
            return [[] if t.text == "No facts." else [d, replace(d, text=d.text + " Again.")]
                    for t, (d,) in zip(turns_, TurnExtractor().extract(turns_), strict=True)]

    await extract_all(settings, engine, embedder, extractor=TwoOrNone())
    async with engine.begin() as conn:
        first = await conn.scalar(select(facts.c.id).where(facts.c.user_id == user).limit(1))
        await set_kv(conn, MODEL, [first], encoded_at=TS, kv_location="x")
        rows = {r.turn_id: r for r in await conn.execute(
            TURN_PROGRESS, {"users": f"{prefix}-%", "model": MODEL})}
    assert rows["t1"].facts == 2 and rows["t1"].encoded_at is None  # one of two encoded
    assert rows["t2"].facts == 0 and rows["t2"].encoded_at == rows["t2"].created_at is not None
