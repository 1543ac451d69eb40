"""Retrieval by cosine distance in pgvector: right fact first, never another user's."""

import random
import uuid
from datetime import UTC, datetime

from inferscale.db.queries import NewFact, upsert_facts
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
