"""Exact injection through the real vLLM engine in every supported model family.

Seeded tiny random models (``models.py``) in fp32, one server per family: Llama with Llama
3.1's rope scaling, Qwen2 (qkv bias), Qwen3 (key norm), Mistral (a sliding window on every
layer), Gemma 3 (sliding and full layers, each type with its own RoPE base, key norm), GLM-4
(interleaved rotary on half the dimensions) and Phi-3 (a fused q|k|v projection, partial
rotary). The plain Llama is ``test_connector_exact.py``'s. One fact, encoded after exactly the
prefix it is served after (window 0, k = 1, stored raw): injected KV must give text prefill's
greedy tokens and top logprobs within 1e-4; a poisoned blob (valid checksum, wrong values) must
not. Windows are shorter than the prompts, so a sliding layer that saw the wrong tokens at
encode or at serving time would show.
"""

import uuid

import pytest
import torch
from sqlalchemy import select

from conftest import running_server
from helpers import ingest_and_encode, max_logprob_diff, tokens_and_logprobs, turn
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.db.tables import facts
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore
from models import KINDS

pytestmark = pytest.mark.slow
FAMILIES = [kind for kind in KINDS if kind != "llama"]
QUESTION = "What does Sam do for a living?"
FACT = "I am a marine biologist at the city aquarium."


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
                         "2048"]) as server:
        yield kind, server


async def test_injected_memory_answers_exactly_as_text_prefill(family, settings, tiny_models,
                                                               engine, embedder):
    kind, server = family
    encoder = FactEncoder(tiny_models[kind], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(server.settings, model_fingerprint(tiny_models[kind]),
                                  host_bytes=1 << 28)
    cfg = settings.model_copy(update={k: getattr(server.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "kv_format", "window")})
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8, "key_scales": False}

    async def user_with_the_fact() -> str:
        user = f"{kind}-{uuid.uuid4().hex[:6]}"
        await ingest_and_encode(cfg, engine, embedder, [turn(user, "t0", "Sam", FACT)],
                                encoder, store)
        return user

    user = await user_with_the_fact()
    injected = server.chat(user, QUESTION, k=1, **kwargs)
    assert injected.headers["x-inferscale-facts-injected"] == "1", injected.text
    windows = [w for w in encoder.shape.windows if w is not None]
    assert injected.json()["usage"]["prompt_tokens"] > max(windows, default=0)
    text = server.chat(user, QUESTION, k=1, mode="text", **kwargs)
    tokens_i, logprobs_i = tokens_and_logprobs(injected)
    tokens_t, logprobs_t = tokens_and_logprobs(text)
    assert tokens_i == tokens_t
    assert max_logprob_diff(logprobs_i, logprobs_t) < 1e-4

    # Negative control: same tokens and a valid checksum, wrong values -> visibly different.
    poisoned = await user_with_the_fact()
    async with engine.connect() as conn:
        fact_id = (await conn.execute(select(facts.c.id).where(
            facts.c.user_id == poisoned))).scalar_one()
    blob = store.load(str(fact_id))
    stored = store.put(str(fact_id), blob.k, blob.v * 3.0, blob.token_ids, window=0)
    async with engine.begin() as conn:
        await conn.execute(facts.update().where(facts.c.id == fact_id).values(
            kv_checksum=stored.checksum))
    bad = server.chat(poisoned, QUESTION, k=1, **kwargs)
    assert bad.headers["x-inferscale-facts-injected"] == "1"
    assert max_logprob_diff(tokens_and_logprobs(bad)[1], logprobs_t) > 1e-2
