"""Chunked RoPE equals vLLM's rotary embedding for the same positions."""

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from inferscale.kv.rope import ChunkedRope, _hf_cos_sin, _vllm_cos_sin, apply_rope


def _vllm_rope(config, dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(config.head_dim, max_position=config.max_position_embeddings,
                        is_neox_style=True, rope_parameters=config.rope_parameters, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_rotation_is_bit_equal_to_vllm_per_layer(smollm2_dir, dtype):
    """One kernel call over every layer equals vLLM rotating each layer's keys as it serves
    them (its fused CPU kernel), bit for bit; the torch fallback agrees to rounding."""
    config = AutoConfig.from_pretrained(smollm2_dir)
    rope = _vllm_rope(config, dtype)
    torch.manual_seed(0)
    layers, tokens = config.num_hidden_layers, 57
    keys = torch.randn(layers, tokens, config.num_key_value_heads, config.head_dim).to(dtype)
    positions = torch.randint(0, 8000, (tokens,))
    chunked = ChunkedRope(config, dtype)
    ours = chunked.rotate(keys, positions)
    assert not torch.equal(ours, keys)  # a copy; the input is left as it was
    for layer in range(layers):
        flat = keys[layer].reshape(tokens, -1).clone()
        _, ref = rope.forward_cpu(positions, flat.clone(), flat)
        assert torch.equal(ours[layer], ref.view_as(keys[layer]))
    fallback = apply_rope(keys, positions, chunked.cos_sin, chunked.rotary_dim)
    tolerance = 2e-6 if dtype == torch.float32 else 0.07  # bf16: an ulp at |x| ~ 4-8
    torch.testing.assert_close(ours, fallback, rtol=0, atol=tolerance)


def test_rotation_in_place_rotates_the_given_keys(smollm2_dir):
    config = AutoConfig.from_pretrained(smollm2_dir)
    rope = ChunkedRope(config, torch.float32)
    keys = torch.randn(3, 5, config.num_key_value_heads, config.head_dim)
    positions = torch.arange(100, 105)
    expected = rope.rotate(keys, positions)
    assert rope.rotate_(keys, positions) is keys
    assert torch.equal(keys, expected)


def test_transformers_fallback_table_equals_vllm():
    for params in ({"rope_type": "default", "rope_theta": 500000.0},
                   {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}):
        config = LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                             max_position_embeddings=16384, rope_parameters=params)
        ours, ours_dim = _hf_cos_sin(config, 16384, torch.float32)
        ref, ref_dim = _vllm_cos_sin(config, 16384, torch.float32)
        assert ours_dim == ref_dim == 128
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scales_ride_in_the_rotation(dtype, partial):
    """Rotating with per-(layer, token) scales equals rotating and then scaling, the
    dimensions RoPE leaves alone included; rows scaled by 1 are bit-equal to plain rotation."""
    config = LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=128, max_position_embeddings=4096, num_hidden_layers=3,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": partial})
    rope = ChunkedRope(config, dtype)
    assert rope.rotary_dim == int(128 * partial)
    torch.manual_seed(0)
    keys = torch.randn(3, 7, 2, 128).to(dtype)
    positions = torch.arange(1000, 1007)
    scales = torch.ones(3, 7)
    scales[:, 2:] = torch.tensor([0.5, 0.8, 1.7])[:, None]
    plain = rope.rotate(keys, positions)
    scaled = rope.rotate(keys, positions, scales.to(dtype))
    assert torch.equal(scaled[:, :2], plain[:, :2])
    tolerance = 1e-5 if dtype == torch.float32 else 0.07  # bf16: an ulp at |x| ~ 4-8
    torch.testing.assert_close(scaled, plain * scales.to(dtype)[..., None, None], rtol=0,
                               atol=tolerance)
    assert not torch.equal(scaled[:, 2:], plain[:, 2:])
    rope._kernel = None  # the torch path (no vLLM): the same rule
    torch.testing.assert_close(rope.rotate(keys, positions, scales.to(dtype)), scaled, rtol=0,
                               atol=tolerance)
