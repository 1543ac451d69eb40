"""Context-Window Encoding exactness on seeded tiny random models (fp32)."""

import os

import pytest
import torch

from inferscale.kv.encoder import FactEncoder
from inferscale.kv.model_family import UnsupportedModel, attention_shape
from inferscale.kv.rope import ChunkedRope
from models import KINDS

CONTEXT = ["3 March 2025 Sam: I moved to Lisbon last month.",
           "3 March 2025 Alex: Do you still work as a nurse?"]
FACT = "3 March 2025 Sam: No, I am a marine biologist at the aquarium now."


def joint_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE K and V of a plain joint prefill, as [layers, tokens, heads, dim] (every
    token's, in sliding-window layers too)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True,
                    past_key_values=DynamicCache())
    layers = out.past_key_values.layers
    k = torch.stack([layer.keys[0].transpose(0, 1) for layer in layers])
    v = torch.stack([layer.values[0].transpose(0, 1) for layer in layers])
    return k, v


@pytest.mark.parametrize("kind", KINDS)
def test_window_covering_everything_matches_joint_prefill(kind, tiny_models):
    encoder = FactEncoder(tiny_models[kind], device="cpu", dtype=torch.float32)
    item = encoder.fact_item(FACT, CONTEXT)
    longer = encoder.fact_item(FACT + " It is great.", CONTEXT * 3)  # forces padding in batch
    span, _ = encoder.encode([item, longer])
    rope = ChunkedRope(encoder.config, torch.float32)
    start = len(item.prefix_ids)
    positions = torch.arange(start, start + len(item.span_ids))
    ref_k, ref_v = joint_kv(encoder.model, item.prefix_ids + item.span_ids)
    rotated = rope.rotate(span.k, positions)
    assert span.k.shape == (encoder.config.num_hidden_layers, len(item.span_ids),
                            encoder.kv_heads, encoder.head_dim)
    torch.testing.assert_close(rotated, ref_k[:, start:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(span.v, ref_v[:, start:], rtol=1e-5, atol=1e-5)
    # Stored keys are pre-RoPE: without rotation they differ from the joint prefill's.
    assert not torch.allclose(span.k, ref_k[:, start:], atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_layer0_exact_at_any_position(kind, tiny_models):
    encoder = FactEncoder(tiny_models[kind], device="cpu", dtype=torch.float32)
    span = encoder.encode([encoder.fact_item(FACT, [])])[0]  # w = 0
    rope = ChunkedRope(encoder.config, torch.float32)
    for context in ([], CONTEXT, CONTEXT * 4):
        item = encoder.fact_item(FACT, context)
        start = len(item.prefix_ids)
        ref_k, ref_v = joint_kv(encoder.model, item.prefix_ids + item.span_ids)
        rotated = rope.rotate(span.k[:1], torch.arange(start, start + len(item.span_ids)))
        torch.testing.assert_close(rotated[0], ref_k[0, start:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(span.v[0], ref_v[0, start:], rtol=1e-5, atol=1e-5)


def test_preamble_kv_is_the_prefix_of_any_prompt(tiny_models):
    encoder = FactEncoder(tiny_models["llama"], device="cpu", dtype=torch.float32)
    preamble = encoder.encode_preamble()
    item = encoder.fact_item(FACT, CONTEXT)
    ref_k, ref_v = joint_kv(encoder.model, item.prefix_ids + item.span_ids)
    n = len(encoder.layout.preamble_ids)
    rope = ChunkedRope(encoder.config, torch.float32)
    torch.testing.assert_close(rope.rotate(preamble.k, torch.arange(n)), ref_k[:, :n],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(preamble.v, ref_v[:, :n], rtol=1e-5, atol=1e-5)


def test_unsupported_models_are_refused_with_the_reason():
    from transformers import DeepseekV3Config, GPT2Config, LlamaConfig, Phi3Config

    with pytest.raises(UnsupportedModel, match="not supported"):
        attention_shape(GPT2Config())
    with pytest.raises(UnsupportedModel, match="latent attention"):
        attention_shape(DeepseekV3Config(num_hidden_layers=2))
    with pytest.raises(UnsupportedModel, match="dynamic NTK"):
        attention_shape(LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                     "rope_theta": 10000.0}))
    with pytest.raises(UnsupportedModel, match="LongRoPE"):
        attention_shape(Phi3Config(max_position_embeddings=8192, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 48,
            "long_factor": [2.0] * 48, "original_max_position_embeddings": 4096}))
    no_rope = LlamaConfig()
    no_rope.rope_parameters = None
    with pytest.raises(UnsupportedModel, match="no rotary"):
        attention_shape(no_rope)


def test_serve_refuses_an_unsupported_model_before_starting(tmp_path):
    """`inferscale serve` with a model of latent attention: a clear error, no vLLM started."""
    import subprocess
    import sys

    from transformers import DeepseekV3Config

    DeepseekV3Config(num_hidden_layers=2).save_pretrained(tmp_path / "model")
    done = subprocess.run([sys.executable, "-m", "inferscale.cli", "serve"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "INFERSCALE_MODEL_PATH": str(
                              tmp_path / "model"), "INFERSCALE_DATA_DIR": str(tmp_path)})
    assert done.returncode != 0
    assert "latent attention" in done.stderr + done.stdout


def test_each_layer_gets_its_window_and_rope_parameters(tiny_models):
    from transformers import AutoConfig, MistralConfig

    gemma = attention_shape(AutoConfig.from_pretrained(tiny_models["gemma3"]))
    assert gemma.windows == (32, 32, None)
    assert [gemma.rope_parameters[i]["rope_theta"] for i in gemma.layer_rope] == [
        10000.0, 10000.0, 1000000.0]
    assert attention_shape(MistralConfig(sliding_window=4096, num_hidden_layers=2)
                           ).windows == (4096, 4096)
    assert attention_shape(MistralConfig(sliding_window=None, num_hidden_layers=2)
                           ).windows == (None, None)
    phi3 = attention_shape(AutoConfig.from_pretrained(tiny_models["phi3"]))
    assert phi3.projection_slice(0) == slice(2 * 64, 3 * 64)  # after the 2 query heads


def test_encode_dtype_setting_picks_the_compute_dtype(tiny_models):
    from inferscale.core.settings import Settings
    from inferscale.kv.encoder import load_encoder

    auto = load_encoder(Settings(model_path=tiny_models["llama"], device="cpu"))
    bf16 = load_encoder(Settings(model_path=tiny_models["llama"], device="cpu",
                                 encode_dtype="bfloat16"))
    assert auto.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    item = auto.fact_item(FACT, CONTEXT)
    a, b = auto.encode([item])[0], bf16.encode([item])[0]
    assert a.k.dtype == b.k.dtype == auto.kv_dtype  # stored as the model serves it
    # Same weights, other arithmetic: close.
    torch.testing.assert_close(a.v.float(), b.v.float(), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("bad", [{"encode_dtype": "float8"}, {"recompute_tail": -1},
                                 {"fact_order": "random"}, {"recompute_tail": "two"},
                                 {"recompute_tail": "AUTO"}, {"recompute_auto_margin": -0.5},
                                 {"recompute_auto_margin": "nan"}, {"recompute_auto_tail": -1},
                                 {"encode_context": "similar"}, {"encode_context": 1},
                                 {"window": -1}, {"window": "five"},
                                 {"lead_encoding": "sometimes"}, {"lead_encoding": [1]},
                                 {"encode_backfill": "later"}, {"encode_backfill": 2},
                                 {"encode_backfill": None}])
def test_fidelity_settings_refuse_bad_values(bad):
    from pydantic import ValidationError

    from inferscale.core.settings import Settings

    with pytest.raises(ValidationError):
        Settings(**bad)
