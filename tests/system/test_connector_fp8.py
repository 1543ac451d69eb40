"""Injection into vLLM's fp8 KV cache (``--kv-cache-dtype fp8``; vLLM's CPU backend has one on
AVX-512 and AMX hosts). The fused writers take bf16 caches only, so the connector writes through
the attention backend's own cache update, which quantises with the layer's scales as the engine
does for prefilled tokens. Text prefill attends to its own tokens' unquantised K/V within its
pass and injected memory is read back from fp8 (as a prefix-cache hit would be), so the two are
close, not equal: the first token's top logprobs are compared (the blob stored raw: this is
about the cache's format, not the blob's)."""

import uuid

import pytest
import torch

from conftest import running_server
from helpers import ingest_and_encode, max_logprob_diff, metric, tokens_and_logprobs, turn
from inferscale.contracts.fingerprint import model_fingerprint
from inferscale.kv.encoder import FactEncoder
from inferscale.kv.store import KVStore

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not torch.cpu._is_avx512_supported(), reason="vLLM's CPU fp8 KV cache needs AVX-512")]


@pytest.fixture(scope="module")
def fp8_served(base_settings, tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    settings = base_settings.model_copy(update={
        "model_path": tiny_models["llama"], "kv_dir": root / "kv", "data_dir": root,
        "window": 0, "top_k": 1, "key_scales": "off"})
    with running_server(settings, root / "server.log",
                        ["--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
                         "--kv-cache-dtype", "fp8"]) as server:
        yield server


async def test_injection_writes_an_fp8_cache_through_the_backend(
        fp8_served, settings, tiny_models, engine, embedder):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    store = KVStore.from_settings(fp8_served.settings, model_fingerprint(tiny_models["llama"]),
                                  host_bytes=1 << 28)
    user = f"fp8-{uuid.uuid4().hex[:6]}"
    cfg = settings.model_copy(update={**{k: getattr(fp8_served.settings, k) for k in (
        "model_path", "kv_dir", "data_dir", "window")}, "kv_format": "raw"})
    await ingest_and_encode(cfg, engine, embedder, [
        turn(user, "t1", "Sam", "I am a marine biologist at the city aquarium.")], encoder, store)
    question = "What does Sam do for a living?"
    kwargs = {"logprobs": True, "top_logprobs": 5, "max_tokens": 8}
    failures = metric(fp8_served, "inferscale_kv_load_failures_total")
    injected = fp8_served.chat(user, question, k=1, **kwargs)
    assert injected.headers["x-inferscale-facts-injected"] == "1"
    # written, not recomputed
    assert metric(fp8_served, "inferscale_kv_load_failures_total") == failures
    text = fp8_served.chat(user, question, k=1, mode="text", **kwargs)
    tokens_i, logprobs_i = tokens_and_logprobs(injected)
    _, logprobs_t = tokens_and_logprobs(text)
    assert len(tokens_i) == 8
    shared = set(logprobs_i[0]) & set(logprobs_t[0])
    assert len(shared) >= 3 and max_logprob_diff(logprobs_i[:1], logprobs_t[:1]) < 0.25
    # Control: without the memory the first token's top 5 are others (measured: none shared)
    none = tokens_and_logprobs(fp8_served.chat(user, question, k=1, mode="none", **kwargs))[1]
    assert len(set(none[0]) & set(logprobs_t[0])) < len(shared)
