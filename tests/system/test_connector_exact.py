"""Exactness of injection on a seeded tiny random Llama in fp32 through the real vLLM engine.

One fact, encoded after exactly the prefix it is served after (window 0, k = 1) and stored raw:
injected KV must reproduce text prefill's greedy tokens and top logprobs within 1e-4 (a coded
blob: exactly what a raw blob of its dequantised values gives). A poisoned blob (valid
checksum, wrong values) must not: that shows the comparison can fail. A fact encoded after
another one is exact when served first only through its lead encoding. The server has key
scales (0.5 per layer): requests that ask for them move away from text prefill, the others
stay exact.
"""

import json
import uuid

import pytest
import torch
from kvrows import set_kv, with_kv
from sqlalchemy import select
from sqlalchemy import text as sa_text

from conftest import running_server
from helpers import ingest_and_encode, max_logprob_diff, tokens_and_logprobs, turn
from inferscale.contracts.blob_name import fact_blob
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.db.tables import fact_kv, facts
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore

pytestmark = pytest.mark.slow
KEY_SCALE = 0.5


@pytest.fixture(scope="module")
def tiny_served(base_settings, tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    scales = root / "key-scales.json"
    scales.write_text(json.dumps({"model": "llama",
                                  "points": [{"facts": 1, "scales": [KEY_SCALE] * 3}]}))
    settings = base_settings.model_copy(update={
        "model_path": tiny_models["llama"], "kv_dir": root / "kv", "data_dir": root,
        "window": 0, "top_k": 1, "key_scales": str(scales), "kv_format": "raw"})
    with running_server(settings, root / "server.log",
                        ["--enforce-eager", "--dtype", "float32", "--max-model-len",
                         "2048"]) as server:
        yield server


async def _fact_id(engine, user: str) -> int:
    """The id of the user's one fact."""
    async with engine.connect() as conn:
        return (await conn.execute(select(facts.c.id).where(
            facts.c.user_id == user))).scalar_one()


async def _user(tiny_served, settings, engine, embedder, encoder, store, *texts, window=0):
    user = f"exact-{uuid.uuid4().hex[:6]}"
    cfg = settings.model_copy(update={**{k: getattr(tiny_served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "kv_format")}, "window": window,
        "lead_share": 1.0})  # every fact with context gets its lead blob (the share's own test
    # is tests/integration/test_encode_worker.py)
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, f"t{i}", "Sam", text, day=i + 1) for i, text in enumerate(texts)],
        encoder, store)
    return user


def _encoder_and_store(tiny_served, tiny_models):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(tiny_served.settings, model_fingerprint(tiny_models["llama"]),
                                  host_bytes=1 << 28)
    return encoder, store


async def test_inject_equals_text_prefill(tiny_served, settings, tiny_models, engine, embedder):
    encoder, store = _encoder_and_store(tiny_served, tiny_models)
    question = "What does Sam do for a living?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    user = await _user(tiny_served, settings, engine, embedder, encoder, store,
                       "I am a marine biologist at the city aquarium.")
    injected = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    assert injected.headers["x-inferscale-facts-injected"] == "1"
    assert injected.json()["kv_transfer_params"]["injected_tokens"] == int(
        injected.headers["x-inferscale-injected-tokens"]) > len(encoder.layout.preamble_ids)
    text = tiny_served.chat(user, question, k=1, mode="text", **kwargs)
    tokens_i, logprobs_i = tokens_and_logprobs(injected)
    tokens_t, logprobs_t = tokens_and_logprobs(text)
    assert tokens_i == tokens_t
    assert max_logprob_diff(logprobs_i, logprobs_t) < 1e-4

    # Negative control: same tokens and a valid checksum, wrong values -> visibly different.
    poisoned = await _user(tiny_served, settings, engine, embedder, encoder, store,
                           "I am a marine biologist at the city aquarium.")
    fact_id = await _fact_id(engine, poisoned)
    blob = store.load(fact_blob(fact_id))
    stored = store.put(fact_blob(fact_id), blob.k, blob.v * 3.0, blob.token_ids, window=0)
    async with engine.begin() as conn:
        await set_kv(conn, store.fingerprint, [fact_id], kv_checksum=stored.checksum)
    bad = tiny_served.chat(poisoned, question, k=1, key_scales=False, **kwargs)
    _, logprobs_bad = tokens_and_logprobs(bad)
    assert max_logprob_diff(logprobs_bad, logprobs_t) > 1e-2


async def _restore(engine, store, fact_id: int, k, v, token_ids, kv_format: str) -> str:
    """Store the fact's blob anew in ``kv_format`` and record its checksum."""
    stored = store.put(fact_blob(fact_id), k, v, token_ids, window=0, kv_format=kv_format)
    async with engine.begin() as conn:
        await set_kv(conn, store.fingerprint, [fact_id], kv_checksum=stored.checksum)
    return stored.checksum


@pytest.mark.parametrize("kv_format", ["int8", "fp8", "int2"])
async def test_a_coded_blob_injects_exactly_its_dequantised_values(
        tiny_served, settings, tiny_models, engine, embedder, kv_format):
    """Served through vLLM, a coded blob answers exactly as a raw blob holding its
    dequantised K/V: what the codes lose is the format's, not the path's."""
    encoder, store = _encoder_and_store(tiny_served, tiny_models)
    question = "What does Sam do for a living?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    user = await _user(tiny_served, settings, engine, embedder, encoder, store,
                       f"I am a marine biologist at the {kv_format} city aquarium.")
    fact_id = await _fact_id(engine, user)
    blob = store.load(fact_blob(fact_id))
    checksum = await _restore(engine, store, fact_id, blob.k, blob.v, blob.token_ids, kv_format)
    coded = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    assert coded.headers["x-inferscale-facts-injected"] == "1"
    k, v = store.load(fact_blob(fact_id), checksum).dequantized()
    await _restore(engine, store, fact_id, k, v, blob.token_ids, "raw")
    plain = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    assert plain.headers["x-inferscale-facts-injected"] == "1"
    tokens_c, logprobs_c = tokens_and_logprobs(coded)
    tokens_p, logprobs_p = tokens_and_logprobs(plain)
    assert tokens_c == tokens_p and max_logprob_diff(logprobs_c, logprobs_p) < 1e-6
    if kv_format == "int2":  # control: the codes are not the encoded values
        await _restore(engine, store, fact_id, blob.k, blob.v, blob.token_ids, "raw")
        exact = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
        assert max_logprob_diff(tokens_and_logprobs(exact)[1], logprobs_c) > 1e-3


async def test_the_fact_served_first_is_exact_through_its_lead_encoding(
        tiny_served, settings, tiny_models, engine, embedder):
    encoder, store = _encoder_and_store(tiny_served, tiny_models)
    question = "Is Sam a marine biologist at the city aquarium?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    # The second fact is encoded after the first (window 1): served alone, right after the
    # preamble, only its lead encoding has exactly its serving prefix.
    user = await _user(tiny_served, settings, engine, embedder, encoder, store,
                       "I have a golden retriever called Max.",
                       "I am a marine biologist at the city aquarium.", window=1)
    async with engine.connect() as conn:
        rows = (await conn.execute(with_kv(store.fingerprint, facts.c.id,
                                           fact_kv.c.kv_lead_checksum).where(
            facts.c.user_id == user).order_by(facts.c.id))).all()
    assert rows[0].kv_lead_checksum is None  # encoded after the preamble alone already
    assert rows[1].kv_lead_checksum is not None
    text = tiny_served.chat(user, question, k=1, mode="text", **kwargs)
    lead = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    no_lead = tiny_served.chat(user, question, k=1, lead=False, key_scales=False, **kwargs)
    for response in (text, lead, no_lead):
        assert response.headers["x-inferscale-fact-ids"] == str(rows[1].id), response.text
    assert lead.headers["x-inferscale-facts-injected"] == "1"
    _, logprobs_t = tokens_and_logprobs(text)
    tokens_lead, logprobs_lead = tokens_and_logprobs(lead)
    assert tokens_lead == tokens_and_logprobs(text)[0]
    assert max_logprob_diff(logprobs_lead, logprobs_t) < 1e-4
    # Control: the fact's own encoding (after the other fact) is measurably off here.
    assert max_logprob_diff(tokens_and_logprobs(no_lead)[1], logprobs_t) > 1e-3


async def test_key_scales_apply_to_the_facts_of_requests_that_ask(tiny_served, settings,
                                                                  tiny_models, engine, embedder):
    encoder, store = _encoder_and_store(tiny_served, tiny_models)
    question = "Where does Sam work?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    user = await _user(tiny_served, settings, engine, embedder, encoder, store,
                       "I work at the city aquarium as a diver.")
    text = tiny_served.chat(user, question, k=1, mode="text", **kwargs)
    scaled = tiny_served.chat(user, question, k=1, **kwargs)  # the server's default: scaled
    unscaled = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    assert scaled.headers["x-inferscale-facts-injected"] == "1"
    _, logprobs_t = tokens_and_logprobs(text)
    assert max_logprob_diff(tokens_and_logprobs(unscaled)[1], logprobs_t) < 1e-4
    # the fact's keys at 0.5 ** 0.75 of their size (the default strength): the question attends
    # to it differently
    assert max_logprob_diff(tokens_and_logprobs(scaled)[1], logprobs_t) > 1e-3
    again = tiny_served.chat(user, question, k=1, **kwargs)  # its own prefix-cache blocks
    assert max_logprob_diff(tokens_and_logprobs(again)[1], tokens_and_logprobs(scaled)[1]) < 1e-4
    # another strength: the keys at 0.5 ** 0.5 of their size, neither unscaled nor the default
    half = tiny_served.chat(user, question, k=1, key_scales=0.5, **kwargs)
    assert half.headers["x-inferscale-facts-injected"] == "1"
    assert max_logprob_diff(tokens_and_logprobs(half)[1], logprobs_t) > 1e-3
    assert max_logprob_diff(tokens_and_logprobs(half)[1], tokens_and_logprobs(scaled)[1]) > 1e-3
    assert max_logprob_diff(tokens_and_logprobs(tiny_served.chat(
        user, question, k=1, key_scales=0, **kwargs))[1], logprobs_t) < 1e-4


async def test_evicted_facts_are_served_as_text_and_come_back_as_kv(
        tiny_served, settings, tiny_models, engine, embedder):
    """A request for a user whose KV the budget evicted is answered, from text, and asks for
    the user's facts back: once encoded again they are injected, exact again."""
    import asyncio

    from inferscale.db.kv_budget import evict_over_budget
    from inferscale.workers.encode import EncodeWorker

    encoder, store = _encoder_and_store(tiny_served, tiny_models)
    question = "What does Sam do for a living?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    user = await _user(tiny_served, settings, engine, embedder, encoder, store,
                       "I am a marine biologist at the evicted city aquarium.")
    text = tiny_served.chat(user, question, k=1, mode="text", **kwargs)
    stamped = "SELECT count(*) FROM fact_kv k JOIN facts f ON f.id = k.fact_id " \
              "WHERE f.user_id = :user AND k.served_at IS NOT NULL"
    for _ in range(100):  # the server stamps the facts it served in the background
        async with engine.connect() as conn:
            if (await conn.execute(sa_text(stamped), {"user": user})).scalar_one():
                break
        await asyncio.sleep(0.1)
    async with engine.begin() as conn:  # every other user's KV counts as served just now
        await conn.execute(sa_text(
            "UPDATE fact_kv k SET served_at = CASE WHEN f.user_id = :user THEN NULL "
            "ELSE now() END FROM facts f WHERE f.id = k.fact_id"), {"user": user})
        evicted = await evict_over_budget(conn, None, 0, grace_s=600.0)
    assert [e.user_id for e in evicted] == [user]
    await asyncio.to_thread(store.delete, [e.location for e in evicted])
    cold = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    assert cold.status_code == 200 and cold.headers["x-inferscale-facts-injected"] == "0"
    assert tokens_and_logprobs(cold)[0] == tokens_and_logprobs(text)[0]  # the same prompt
    for _ in range(50):  # the server marks the user's facts wanted, off the request
        async with engine.connect() as conn:
            wanted = (await conn.execute(with_kv(store.fingerprint, fact_kv.c.kv_wanted_at)
                                         .where(facts.c.user_id == user))).scalar_one()
        if wanted is not None:
            break
        await asyncio.sleep(0.1)
    assert wanted is not None
    cfg = settings.model_copy(update={k: getattr(tiny_served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "window", "kv_format")})
    await EncodeWorker(cfg, engine, encoder, store).run(drain=True)
    warm = tiny_served.chat(user, question, k=1, key_scales=False, **kwargs)
    assert warm.headers["x-inferscale-facts-injected"] == "1"
    tokens_w, logprobs_w = tokens_and_logprobs(warm)
    assert tokens_w == tokens_and_logprobs(text)[0]
    assert max_logprob_diff(logprobs_w, tokens_and_logprobs(text)[1]) < 1e-4
