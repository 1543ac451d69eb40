"""Exactness of injection on a seeded tiny random Llama in fp32 through the real vLLM engine.

One fact, encoded after exactly the prefix it is served after (window 0, k = 1): injected KV
must reproduce text prefill's greedy tokens and top logprobs within 1e-4. A poisoned blob (valid
checksum, wrong values) must not: that shows the comparison can fail.
"""

import uuid

import pytest
import torch
from sqlalchemy import select

from conftest import running_server
from helpers import ingest_and_encode, turn
from inferscale.db.tables import facts
from inferscale.encoder import FactEncoder
from inferscale.fingerprint import model_fingerprint
from inferscale.kvstore import KVStore

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_served(base_settings, tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    settings = base_settings.model_copy(update={
        "model_path": tiny_models["llama"], "kv_dir": root / "kv", "data_dir": root,
        "window": 0, "top_k": 1})
    with running_server(settings, root / "server.log",
                        ["--enforce-eager", "--dtype", "float32", "--max-model-len",
                         "2048"]) as server:
        yield server


def _tokens_and_logprobs(response) -> tuple[list[str], list[dict[str, float]]]:
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["logprobs"]["content"]
    return ([c["token"] for c in content],
            [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content])


def _max_diff(a: list[dict[str, float]], b: list[dict[str, float]]) -> float:
    return max(abs(x[t] - y[t]) for x, y in zip(a, b, strict=True) for t in x if t in y)


async def _one_fact_user(tiny_served, settings, engine, embedder, encoder, store, text):
    user = f"exact-{uuid.uuid4().hex[:6]}"
    cfg = settings.model_copy(update={k: getattr(tiny_served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "window")})
    await ingest_and_encode(cfg, engine, embedder, [turn(user, "t1", "Sam", text)],
                            encoder, store)
    return user


async def test_inject_equals_text_prefill(tiny_served, settings, tiny_models, engine, embedder):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(tiny_served.settings, model_fingerprint(tiny_models["llama"]),
                                  host_bytes=1 << 28)
    question = "What does Sam do for a living?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    user = await _one_fact_user(tiny_served, settings, engine, embedder, encoder, store,
                                "I am a marine biologist at the city aquarium.")
    injected = tiny_served.chat(user, question, k=1, **kwargs)
    assert injected.headers["x-inferscale-facts-injected"] == "1"
    assert injected.json()["kv_transfer_params"]["injected_tokens"] == int(
        injected.headers["x-inferscale-injected-tokens"]) > len(encoder.layout.preamble_ids)
    text = tiny_served.chat(user, question, k=1, mode="text", **kwargs)
    tokens_i, logprobs_i = _tokens_and_logprobs(injected)
    tokens_t, logprobs_t = _tokens_and_logprobs(text)
    assert tokens_i == tokens_t
    assert _max_diff(logprobs_i, logprobs_t) < 1e-4

    # Negative control: same tokens and a valid checksum, wrong values -> visibly different.
    poisoned = await _one_fact_user(tiny_served, settings, engine, embedder, encoder, store,
                                    "I am a marine biologist at the city aquarium.")
    async with engine.connect() as conn:
        fact_id = (await conn.execute(select(facts.c.id).where(
            facts.c.user_id == poisoned))).scalar_one()
    blob = store.load(str(fact_id))
    stored = store.put(str(fact_id), blob.k, blob.v * 3.0, blob.token_ids, window=0)
    async with engine.begin() as conn:
        await conn.execute(facts.update().where(facts.c.id == fact_id).values(
            kv_checksum=stored.checksum))
    bad = tiny_served.chat(poisoned, question, k=1, **kwargs)
    _, logprobs_bad = _tokens_and_logprobs(bad)
    assert _max_diff(logprobs_bad, logprobs_t) > 1e-2
