"""The real Gemma 3 270M (a sliding-window hybrid: 15 layers of 512-token windows, 3 full
ones, one KV head of 256 dimensions) served with memory as a user serves it: bf16, prepared
from its PyPI packages, the memory encoded by the worker. Injected memory is bf16 KV computed
in another pass than text prefill's, so the two are close, not equal: the first token's top
logprobs are compared, with a no-memory control. The memory spans more than one window, so
the question's sliding layers see only its last facts, at encode and at serving time alike."""

import uuid

import pytest
import torch

from conftest import running_server
from helpers import ingest_and_encode, metric, tokens_and_logprobs, turn
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore

pytestmark = pytest.mark.slow
FACTS = [f"I went to the {place} on day {day} and loved the {thing} there." for day, (place, thing)
         in enumerate([("harbour", "boats"), ("museum", "paintings"), ("bakery", "bread"),
                       ("library", "quiet"), ("stadium", "noise"), ("garden", "roses"),
                       ("market", "spices"), ("beach", "waves"), ("zoo", "tigers"),
                       ("castle", "towers"), ("forest", "birds"), ("lake", "swans"),
                       ("theatre", "actors"), ("cafe", "coffee"), ("river", "bridges"),
                       ("farm", "horses"), ("mountain", "views"), ("island", "sand"),
                       ("gallery", "sculptures"), ("festival", "music")], start=1)]


@pytest.fixture(scope="module")
def gemma_served(base_settings, gemma3_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    settings = base_settings.model_copy(update={
        "model_path": gemma3_dir, "kv_dir": root / "kv", "data_dir": root, "window": 3,
        "top_k": len(FACTS)})
    with running_server(settings, root / "server.log", ["--enforce-eager"]) as server:
        yield server


async def test_gemma3_answers_from_injected_memory_as_from_prefilled_memory(
        gemma_served, settings, gemma3_dir, engine, embedder):
    encoder = FactEncoder(gemma3_dir, device="cpu")
    store = KVStore.from_settings(gemma_served.settings, model_fingerprint(gemma3_dir),
                                  host_bytes=1 << 30)
    user = f"gemma-{uuid.uuid4().hex[:6]}"
    cfg = settings.model_copy(update={k: getattr(gemma_served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "window", "kv_format")})
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, f"t{i}", "Sam", text, day=i + 1) for i, text in enumerate(FACTS)],
        encoder, store)
    question = "Where did Sam see the swans?"
    kwargs = {"logprobs": True, "top_logprobs": 20, "max_tokens": 8}
    failures = metric(gemma_served, "inferscale_kv_load_failures_total")
    injected = gemma_served.chat(user, question, **kwargs)
    assert injected.headers["x-inferscale-facts-injected"] == str(len(FACTS))
    # written, not recomputed
    assert metric(gemma_served, "inferscale_kv_load_failures_total") == failures
    assert int(injected.headers["x-inferscale-injected-tokens"]) > 512  # past one window
    text = gemma_served.chat(user, question, mode="text", **kwargs)
    assert text.headers["x-inferscale-fact-ids"] == injected.headers["x-inferscale-fact-ids"]
    _, logprobs_i = tokens_and_logprobs(injected)
    _, logprobs_t = tokens_and_logprobs(text)
    # The first token's top 20: mostly the same tokens, and text prefill's 5 likeliest at close
    # logprobs (a base model's first-token distribution is flat: bf16 moves its tail more).
    shared = set(logprobs_i[0]) & set(logprobs_t[0])
    likeliest = sorted(logprobs_t[0], key=logprobs_t[0].get, reverse=True)[:5]
    drift = max(abs(logprobs_i[0].get(t, -30.0) - logprobs_t[0][t]) for t in likeliest)
    none = tokens_and_logprobs(gemma_served.chat(user, question, mode="none", **kwargs))[1]
    away = max(abs(none[0].get(t, -30.0) - logprobs_t[0][t]) for t in likeliest)
    # measured: 19 of 20 shared, 0.67 nats at most (int4 KV, every fact injected), no memory
    # much further off
    assert len(shared) >= 15 and drift < 1.0 and away > 2 * drift, (len(shared), drift, away)


def test_prepared_gemma3_starts_every_prompt_with_bos_and_continues_sensibly(gemma3_dir):
    """The Gemma GGUF's tokenizer adds no <bos> and ships no chat template: the prepared folder
    has a template for a base model (memories, then "Question:" / "Answer:") that starts with
    <bos> and renders a system message alone (the memory layout's preamble); with it the base
    model answers from the memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from inferscale.contracts.layout import MemoryLayout
    from inferscale.kv.model_family import attention_shape

    shape = attention_shape(AutoConfig.from_pretrained(gemma3_dir))
    assert shape.layers == 18 and shape.kv_heads == 1 and shape.head_dim == 256
    assert shape.windows.count(None) == 3 and set(shape.windows) == {512, None}
    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    layout = MemoryLayout(tokenizer)
    assert layout.preamble_ids[0] == tokenizer.bos_token_id
    plan = layout.compose([layout.fact_segment("8 May 2023 Melanie: I painted a lake sunrise.")],
                          [{"role": "user", "content": "What did Melanie paint?"}])
    assert plan.token_ids.count(tokenizer.bos_token_id) == 1
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([plan.token_ids]), max_new_tokens=12, do_sample=False)
    assert "lake" in tokenizer.decode(out[0, len(plan.token_ids):]).lower()
