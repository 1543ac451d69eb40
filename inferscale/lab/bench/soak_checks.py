"""The soak's end-of-run checks: nothing lost or duplicated, every live fact's KV present or
re-encodable, no answer served a retired or another user's fact, the KV budgets held.

The comparisons are pure functions of the load's logs and rows read from Postgres (unit-tested);
the queries that read those rows are here too. A budget is held when, at every sample, the tier
holds no more than the larger of its budget and the KV served within the eviction grace (which
the policy spares), plus the KV encoded since the last eviction round (which no round has seen
yet): the margin the policy states (``db/kv_budget.py``). A sample cannot see when the last round
ran (a round runs before an encode batch once its interval is due, so a slow batch delays it),
so it allows what the policy allowed at any moment of a window ``recent_s`` before it: KV in the
grace then, and KV encoded since.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from inferscale.lab.bench.soak_load import Answer, Edit


def turn_check(published: Iterable[tuple[str, str]], stored: Counter, facts: Counter) -> dict:
    """Each published turn (user, turn id) stored once and extracted into one fact (the
    ``turn`` extractor's, retired or not); ``stored`` / ``facts``: rows per turn."""
    published = set(published)
    return {"published": len(published),
            "lost": sum(1 for key in published if stored[key] == 0),
            "duplicated": sum(1 for key in published if stored[key] > 1),
            "facts_lost": sum(1 for key in published if facts[key] == 0),
            "facts_duplicated": sum(1 for key in published if facts[key] > 1),
            "stored_not_published": sum(1 for key in stored if key not in published)}


def stale_answers(answers: Iterable[Answer], edits: Iterable[Edit]) -> list[dict]:
    """Answers that served a fact after the memory API had retired it (the request started
    after the edit or delete was answered)."""
    retired = {e.fact_id: e for e in edits}
    return [{"user": a.user, "started": a.started, "fact_id": f, "retired": retired[f].done,
             "op": retired[f].op}
            for a in answers for f in a.fact_ids
            if f in retired and a.started > retired[f].done]


def foreign_answers(answers: Iterable[Answer], owners: dict[int, str]) -> list[dict]:
    """Answers that served a fact of another user (or a fact id no row has)."""
    return [{"user": a.user, "started": a.started, "fact_id": f, "owner": owners.get(f)}
            for a in answers for f in a.fact_ids if owners.get(f) != a.user]


@dataclass(frozen=True)
class BudgetSample:
    """What the KV tier held at one moment, by user: bytes held, of them in the grace at some
    moment of the window before it, and encoded within that window (or held by an encode)."""

    at: float
    held: dict[str, int]
    in_grace: dict[str, int]
    recent: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.held.values())


def budget_excess(sample: BudgetSample, budget: int | None, user_budget: int | None
                  ) -> tuple[int, int]:
    """Bytes over the policy's bound at this sample: for the tier, and the worst user's
    (0: within; the bound is the larger of the budget and the KV in grace, plus recent KV)."""
    tier = 0
    if budget is not None:
        bound = max(budget, sum(sample.in_grace.values())) + sum(sample.recent.values())
        tier = max(0, sample.total - bound)
    user = 0
    if user_budget is not None:
        user = max((held - max(user_budget, sample.in_grace.get(u, 0)) - sample.recent.get(u, 0)
                    for u, held in sample.held.items()), default=0)
    return tier, max(0, user)


_HELD = text("""
    SELECT f.user_id, sum(coalesce(k.kv_bytes, 0)) AS held,
           coalesce(sum(k.kv_bytes) FILTER (
               WHERE k.served_at >= now() - make_interval(secs => :grace_window_s)), 0)
               AS in_grace,
           coalesce(sum(k.kv_bytes) FILTER (
               WHERE k.encoded_at >= now() - make_interval(secs => :recent_s)
                  OR k.claimed_until > now()), 0) AS recent
    FROM fact_kv k JOIN facts f ON f.id = k.fact_id
    WHERE k.kv_location IS NOT NULL AND f.deleted_at IS NULL
    GROUP BY f.user_id
""")


async def budget_sample(conn: AsyncConnection, at: float, grace_s: float, recent_s: float
                        ) -> BudgetSample:
    """The tier's bytes now, every model's (as the budgets count them), against what the
    policy allowed within the last ``recent_s`` seconds."""
    rows = (await conn.execute(_HELD, {"grace_window_s": grace_s + recent_s,
                                       "recent_s": recent_s})).all()
    return BudgetSample(at, {r.user_id: int(r.held) for r in rows},
                        {r.user_id: int(r.in_grace) for r in rows},
                        {r.user_id: int(r.recent) for r in rows})


async def stored_rows(conn: AsyncConnection, prefix: str) -> tuple[Counter, Counter]:
    """Turn rows and ``turn``-extractor fact rows per (user, turn id) of the soak's users."""
    turns = Counter({(r.user_id, r.turn_id): r.n for r in (await conn.execute(text(
        "SELECT user_id, turn_id, count(*) AS n FROM turns WHERE user_id LIKE :p "
        "GROUP BY 1, 2"), {"p": f"{prefix}-%"})).all()})
    facts = Counter({(r.user_id, r.turn_id): r.n for r in (await conn.execute(text(
        "SELECT user_id, unnest(turn_ids) AS turn_id, count(*) AS n FROM facts "
        "WHERE user_id LIKE :p AND extractor = 'turn' GROUP BY 1, 2"),
        {"p": f"{prefix}-%"})).all()})
    return turns, facts


async def fact_owners(conn: AsyncConnection, ids: Iterable[int]) -> dict[int, str]:
    """The owner of each fact id that has a row."""
    rows = await conn.execute(text("SELECT id, user_id FROM facts WHERE id = ANY(:ids)"),
                              {"ids": sorted(set(ids))})
    return {r.id: r.user_id for r in rows}


_LIVE_KV = text("""
    SELECT f.id, k.kv_location, k.kv_checksum, k.kv_evicted_at IS NOT NULL AS evicted,
           k.encode_error, k.encode_attempts
    FROM facts f JOIN fact_kv k ON k.fact_id = f.id AND k.model_fingerprint = :model
    WHERE f.user_id LIKE :p AND f.deleted_at IS NULL
""")


async def live_kv(conn: AsyncConnection, prefix: str, model: str) -> list:
    """The soak users' live facts and their KV state for ``model``."""
    return list((await conn.execute(_LIVE_KV, {"p": f"{prefix}-%", "model": model})).all())


def kv_state(row, verified: bool | None, max_attempts: int) -> str:
    """A live fact's KV at the end: ``present`` (its blob verified), ``broken`` (recorded but
    missing or corrupt), ``evicted`` / ``pending`` (none now: encoded again when wanted /
    queued), ``quarantined`` or ``failed`` (never encoded again: not re-encodable)."""
    if row.kv_location is not None:
        return "present" if verified else "broken"
    error = row.encode_error or ""
    if error.startswith("quarantined"):
        return "quarantined"
    if error and not error.startswith("storage") and row.encode_attempts >= max_attempts:
        return "failed"
    return "evicted" if row.evicted else "pending"
