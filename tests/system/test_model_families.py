"""Exact injection through the real vLLM engine in every supported model family.

Seeded tiny random models (``models.py``) in fp32, one server per family: Llama with Llama
3.1's rope scaling, Qwen2 (qkv bias), Qwen3 (key norm), Mistral (a sliding window on every
layer), Gemma 3 (sliding and full layers, each type with its own RoPE base, key norm), GLM-4
(interleaved rotary on half the dimensions) and Phi-3 (a fused q|k|v projection, partial
rotary). The plain Llama is ``test_connector_exact.py``'s. One fact, encoded after exactly the
prefix it is served after (window 0, k = 1, stored raw): injected KV must give text prefill's
greedy tokens and top logprobs within 1e-4; a poisoned blob (valid checksum, wrong values) must
not. Windows are shorter than the prompts, so a sliding layer that saw the wrong tokens at
encode or at serving time would show; with 32-token blocks vLLM's hybrid KV cache manager keeps
no block before a sliding layer's window, and the connector writes no rows there (Gemma 3: two
KV cache groups; Mistral: one sliding group; both load asynchronously). A damaged blob fails its
load, and the request is recomputed: text prefill's answer. One memory, encoded for every family
in turn by its own worker, is injected by each family's server with its own model's KV, none of
the others' lost.
"""

import uuid

import pytest
import torch
from kvrows import set_kv, with_kv
from sqlalchemy import select

from conftest import running_server
from helpers import ingest_and_encode, max_logprob_diff, metric, tokens_and_logprobs, turn
from inferscale.contracts.blob_name import fact_blob
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.core.settings import Settings
from inferscale.db.tables import fact_kv, facts
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore
from inferscale.workers.encode import EncodeWorker
from models import KINDS

pytestmark = pytest.mark.slow
FAMILIES = [kind for kind in KINDS if kind != "llama"]
QUESTION = "What does Sam do for a living?"
FACT = ("I am a marine biologist at the city aquarium, where I have studied how sea turtles "
        "find their way along the northern coast for eleven years.")
EXACT = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8, "key_scales": False}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, base_settings, tiny_models, tmp_path_factory):
    """(family, its running server), one family after the other."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"family-{kind}")
    settings = base_settings.model_copy(update={
        "model_path": tiny_models[kind], "kv_dir": root / "kv", "data_dir": root,
        "window": 0, "top_k": 1, "kv_format": "raw"})
    with running_server(settings, root / "server.log",
                        ["--enforce-eager", "--dtype", "float32", "--max-model-len",
                         "2048", "--block-size", "32"]) as server:
        yield kind, server


def _worker_parts(family, settings, tiny_models) -> tuple[FactEncoder, KVStore, Settings]:
    """The family's encoder (fp32), its server's KV store and a worker's settings for it."""
    kind, server = family
    encoder = FactEncoder(tiny_models[kind], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(server.settings, model_fingerprint(tiny_models[kind]),
                                  host_bytes=1 << 28)
    cfg = settings.model_copy(update={k: getattr(server.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "kv_format", "window")})
    return encoder, store, cfg


async def test_injected_memory_answers_exactly_as_text_prefill(family, settings, tiny_models,
                                                               engine, embedder):
    kind, server = family
    encoder, store, cfg = _worker_parts(family, settings, tiny_models)

    async def user_with_the_fact() -> str:
        user = f"{kind}-{uuid.uuid4().hex[:6]}"
        await ingest_and_encode(cfg, engine, embedder, [turn(user, "t0", "Sam", FACT)],
                                encoder, store)
        return user

    user = await user_with_the_fact()
    skipped = metric(server, "inferscale_kv_window_skipped_rows_total")
    injected = server.chat(user, QUESTION, k=1, **EXACT)
    assert injected.headers["x-inferscale-facts-injected"] == "1", injected.text
    skipping = metric(server, "inferscale_kv_window_skipped_rows_total") > skipped
    assert skipping == (kind in ("gemma3", "mistral"))  # the families with sliding windows
    windows = [w for w in encoder.shape.windows if w is not None]
    assert injected.json()["usage"]["prompt_tokens"] > max(windows, default=0)
    text = server.chat(user, QUESTION, k=1, mode="text", **EXACT)
    tokens_i, logprobs_i = tokens_and_logprobs(injected)
    tokens_t, logprobs_t = tokens_and_logprobs(text)
    assert tokens_i == tokens_t
    assert max_logprob_diff(logprobs_i, logprobs_t) < 1e-4

    # Negative control: same tokens and a valid checksum, wrong values -> visibly different.
    poisoned = await user_with_the_fact()
    async with engine.connect() as conn:
        fact_id = (await conn.execute(select(facts.c.id).where(
            facts.c.user_id == poisoned))).scalar_one()
    blob = store.load(fact_blob(fact_id))
    stored = store.put(fact_blob(fact_id), blob.k, blob.v * 3.0, blob.token_ids, window=0)
    async with engine.begin() as conn:
        await set_kv(conn, store.fingerprint, [fact_id], kv_checksum=stored.checksum)
    bad = server.chat(poisoned, QUESTION, k=1, **EXACT)
    assert bad.headers["x-inferscale-facts-injected"] == "1"
    assert max_logprob_diff(tokens_and_logprobs(bad)[1], logprobs_t) > 1e-2

    # A blob whose bytes are damaged fails its load: vLLM recomputes the request (per request
    # where loads are asynchronous, under the hybrid manager), which answers as text prefill.
    damaged = await user_with_the_fact()
    async with engine.connect() as conn:
        location = (await conn.execute(with_kv(store.fingerprint, fact_kv.c.kv_location).where(
            facts.c.user_id == damaged))).scalar_one()
    path = store.durable.root / location
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x55
    path.write_bytes(bytes(raw))
    failures = metric(server, "inferscale_kv_load_failures_total")
    recomputed = server.chat(damaged, QUESTION, k=1, **EXACT)
    assert metric(server, "inferscale_kv_load_failures_total") == failures + 1
    as_text = server.chat(damaged, QUESTION, k=1, mode="text", **EXACT)
    tokens_r, logprobs_r = tokens_and_logprobs(recomputed)
    assert tokens_r == tokens_and_logprobs(as_text)[0]
    assert max_logprob_diff(logprobs_r, tokens_and_logprobs(as_text)[1]) < 1e-4


@pytest.fixture(scope="module")
def one_memory() -> dict:
    """One user's memory that every family's worker encodes and server serves in turn."""
    return {"user": f"shared-{uuid.uuid4().hex[:6]}", "models": []}


async def test_one_memory_is_injected_by_every_family_with_its_own_kv(
        family, one_memory, settings, tiny_models, engine, embedder):
    """The same fact, encoded for each family's model by that model's worker (registering a
    model enrols every live fact): each server injects its own model's KV of it and answers as
    text prefill does, and the KV made for the families before stays."""
    _, server = family
    encoder, store, cfg = _worker_parts(family, settings, tiny_models)
    user = one_memory["user"]
    if not one_memory["models"]:
        await ingest_and_encode(cfg, engine, embedder, [turn(user, "t0", "Sam", FACT)],
                                encoder, store)
    else:
        await EncodeWorker(cfg, engine, encoder, store).run(drain=True)
    one_memory["models"].append(store.fingerprint)
    injected = server.chat(user, QUESTION, k=1, **EXACT)
    assert injected.headers["x-inferscale-facts-injected"] == "1", injected.text
    text = server.chat(user, QUESTION, k=1, mode="text", **EXACT)
    tokens_i, logprobs_i = tokens_and_logprobs(injected)
    tokens_t, logprobs_t = tokens_and_logprobs(text)
    assert tokens_i == tokens_t and max_logprob_diff(logprobs_i, logprobs_t) < 1e-4
    async with engine.connect() as conn:
        held = (await conn.execute(select(fact_kv.c.model_fingerprint).join(
            facts, facts.c.id == fact_kv.c.fact_id).where(
            facts.c.user_id == user, fact_kv.c.kv_location.is_not(None)))).scalars().all()
    assert sorted(held) == sorted(one_memory["models"])  # one KV per model, none lost
