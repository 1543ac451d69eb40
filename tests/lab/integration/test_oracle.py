"""Oracle-window encoding for the fidelity eval's drift decomposition (Postgres, tiny model)."""

import uuid

import torch
from kvrows import with_kv
from sqlalchemy import select

from helpers import ingest_and_encode, turn
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.db.tables import facts
from inferscale.kv.durable import LocalDir
from inferscale.kv.encoder import EncodeItem, FactEncoder
from inferscale.kv.store import KVStore
from inferscale.lab.oracle import oracle_owner


async def test_oracle_copies_carry_kv_of_their_serving_prefix(settings, engine, embedder,
                                                             tiny_models, tmp_path):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    store = KVStore(LocalDir(tmp_path / "kv"), model_fingerprint(tiny_models["llama"]),
                    host_bytes=0)
    user = f"oracle-src-{uuid.uuid4().hex[:8]}"
    said = ["I moved to Lisbon.", "My octopus is called Pickles.", "I work at the aquarium.",
            "I paint sunrises on weekends."]
    await ingest_and_encode(settings, engine, embedder,
                            [turn(user, f"t{i}", "Sam", text) for i, text in enumerate(said)])
    async with engine.connect() as conn:
        ids = list((await conn.execute(select(facts.c.id).where(facts.c.user_id == user)
                                       .order_by(facts.c.id))).scalars())
    prompt_order = [ids[2], ids[0], ids[3]]
    owner = f"oracle-{uuid.uuid4().hex[:8]}"
    originals = await oracle_owner(engine, encoder, store, prompt_order, owner)

    async with engine.connect() as conn:
        copies = (await conn.execute(with_kv(store.fingerprint).where(facts.c.user_id == owner)
                                     .order_by(facts.c.id))).all()
        source = {r.id: r for r in (await conn.execute(
            select(facts).where(facts.c.id.in_(ids)))).all()}
    # Copies keep the originals' id order, texts and embeddings, and carry recorded KV.
    assert [originals[c.id] for c in copies] == sorted(prompt_order)
    for copy in copies:
        original = source[originals[copy.id]]
        assert copy.text == original.text and list(copy.embedding) == list(original.embedding)
        assert copy.kv_location and copy.window == -1
        assert copy.token_ids == encoder.layout.fact_segment(original.text)
    # Each copy's KV is its slice of one joint encode of [preamble][facts in prompt order].
    preamble = list(encoder.layout.preamble_ids)
    memory = preamble + [t for f in prompt_order
                         for t in encoder.layout.fact_segment(source[f].text)]
    joint = encoder.encode([EncodeItem(prefix_ids=[], span_ids=memory)])[0]
    by_original = {originals[c.id]: c for c in copies}
    start = len(preamble)
    for fact_id in prompt_order:
        copy = by_original[fact_id]
        blob = store.get(copy.kv_location, copy.kv_checksum)
        end = start + copy.token_count
        torch.testing.assert_close(blob.k, joint.k[:, start:end])
        torch.testing.assert_close(blob.v, joint.v[:, start:end])
        start = end
    # Not the KV of the fact encoded after the preamble alone: the context is really there.
    second = source[prompt_order[1]]
    alone = encoder.encode([EncodeItem(prefix_ids=preamble,
                                       span_ids=encoder.layout.fact_segment(second.text))])[0]
    oracle = store.get(by_original[second.id].kv_location)
    assert not torch.allclose(alone.v[1:], oracle.v[1:], atol=1e-4)
