"""Retrieval by cosine distance in pgvector: right fact first, never another user's."""

import random
import uuid
from datetime import UTC, datetime

import numpy as np

from inferscale.db.queries import NewFact, top_k_facts, upsert_facts
from inferscale.retrieval import retrieve

FACTS = {
    "alice": ["Alice's cat is named Tiger.", "Alice works as a pilot for a cargo airline.",
              "Alice is allergic to shellfish.", "Alice plays the violin on weekends."],
    "bob": ["Bob's cat is named Shadow.", "Bob works as a baker in Lyon.",
            "Bob is allergic to cats.", "Bob plays chess every Monday."],
}


async def _store(engine, embedder, owners: dict[str, str]) -> None:
    rows = []
    for name, texts in FACTS.items():
        vectors = embedder.encode(texts)
        rows += [NewFact(user_id=owners[name], conversation_id="c", turn_ids=(f"t{i}",),
                         ordinal=0, extractor="test", text=text, ts=datetime.now(UTC),
                         embedding=vec.tolist())
                 for i, (text, vec) in enumerate(zip(texts, vectors, strict=True))]
    async with engine.begin() as conn:
        assert await upsert_facts(conn, rows) == len(rows)


async def test_right_fact_first_and_only_own_facts(engine, embedder):
    owners = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in FACTS}
    await _store(engine, embedder, owners)
    hits = await retrieve(engine, embedder, owners["alice"], "What is the name of the cat?", 2)
    assert hits[0].text == "Alice's cat is named Tiger."
    hits = await retrieve(engine, embedder, owners["bob"], "What is his job?", 4)
    assert hits[0].text == "Bob works as a baker in Lyon."
    assert {h.text for h in hits} == set(FACTS["bob"])
    rng = random.Random(0)
    questions = ["cat", "job", "allergy", "hobby", "Tiger", "Shadow", "violin", "chess"]
    for _ in range(40):
        name = rng.choice(list(FACTS))
        hits = await retrieve(engine, embedder, owners[name], rng.choice(questions), 10)
        assert {h.text for h in hits} == set(FACTS[name])
    assert await retrieve(engine, embedder, "nobody-" + uuid.uuid4().hex, "cat", 5) == []


async def test_other_owners_nearer_facts_never_displace_the_owners_own(engine):
    """Hundreds of other owners' facts sit nearer the query than the owner's own: the search
    still returns k of the owner's, the exact nearest, in order (a global ANN index walked first
    and filtered by owner after returned fewer than k without iterative scans, and missed
    nearest ones with them; migration 0007)."""
    rng = np.random.default_rng(3)
    query = rng.standard_normal(384).astype(np.float32)
    query /= np.linalg.norm(query)
    owner, others = f"owner-{uuid.uuid4().hex[:6]}", f"crowd-{uuid.uuid4().hex[:6]}"
    near = query + 0.05 * rng.standard_normal((400, 384)).astype(np.float32)
    far = rng.standard_normal((6, 384)).astype(np.float32)
    rows = [NewFact(user_id=user, conversation_id="c", turn_ids=(f"t{i}",), ordinal=0,
                    extractor="test", text=f"{user} {i}", ts=datetime.now(UTC),
                    embedding=(vec / np.linalg.norm(vec)).tolist())
            for user, vectors in ((others, near), (owner, far)) for i, vec in enumerate(vectors)]
    async with engine.begin() as conn:
        await upsert_facts(conn, rows)
        hits = await top_k_facts(conn, owner, query.tolist(), 5)
    assert [h.text.split()[0] for h in hits] == [owner] * 5
    distances = [h.distance for h in hits]
    assert distances == sorted(distances)
    # the owner's 5 of 6 nearest, as an exact scan finds them
    exact = sorted(range(len(far)), key=lambda i: float(far[i] @ query)
                   / -float(np.linalg.norm(far[i])))[:5]
    assert [h.text for h in hits] == [f"{owner} {i}" for i in exact]
