"""Chunked RoPE equals vLLM's rotary embedding for the same positions, in every family."""

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from inferscale.kv.model_family import attention_shape
from inferscale.kv.rope import ChunkedRope, _hf_cos_sin, _vllm_cos_sin, apply_rope


def _vllm_rope(config, params, neox, dtype):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(attention_shape(config).head_dim,
                        max_position=config.max_position_embeddings, is_neox_style=neox,
                        rope_parameters=params, dtype=dtype)


def _layer_params(config, layer: int):
    """The RoPE parameters vLLM's model gives ``layer``: per layer type where the config has
    them so (Gemma 3), else the one set."""
    params = config.rope_parameters
    if all(isinstance(value, dict) for value in params.values()):
        return params[config.layer_types[layer]]
    return params


@pytest.mark.parametrize("kind", ["smollm2", "llama3", "gemma3", "glm4", "phi3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_rotation_is_bit_equal_to_vllm_per_layer(smollm2_dir, tiny_models, kind, dtype):
    """One kernel call over every layer equals vLLM rotating each layer's keys as it serves
    them (its fused CPU kernel, with the layer's own parameters and the family's style), bit
    for bit; the torch fallback agrees to rounding."""
    config = AutoConfig.from_pretrained(smollm2_dir if kind == "smollm2" else tiny_models[kind])
    shape = attention_shape(config)
    torch.manual_seed(0)
    layers, tokens = config.num_hidden_layers, 57
    keys = torch.randn(layers, tokens, shape.kv_heads, shape.head_dim).to(dtype)
    positions = torch.randint(0, 4000, (tokens,))
    chunked = ChunkedRope(config, dtype)
    ours = chunked.rotate(keys, positions)
    assert not torch.equal(ours, keys)  # a copy; the input is left as it was
    for layer in range(layers):
        rope = _vllm_rope(config, _layer_params(config, layer), shape.family.neox, dtype)
        flat = keys[layer].reshape(tokens, -1).clone()
        _, ref = rope.forward_cpu(positions, flat.clone(), flat)
        assert torch.equal(ours[layer], ref.view_as(keys[layer])), layer
    fallback = apply_rope(keys.flatten(0, 1), chunked.rows(layers, positions), chunked.cos_sin,
                          chunked.rotary_dim, chunked.neox).view_as(keys)
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


def test_transformers_fallback_table_equals_vllm(tiny_models):
    configs = [LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                           max_position_embeddings=16384, rope_parameters=params)
               for params in ({"rope_type": "default", "rope_theta": 500000.0},
                              {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})]
    configs += [AutoConfig.from_pretrained(tiny_models[kind]) for kind in ("gemma3", "glm4")]
    for config in configs:
        shape = attention_shape(config)
        for params in shape.rope_parameters:
            ours, ours_dim = _hf_cos_sin(config, params, 4096, torch.float32)
            ref, ref_dim = _vllm_cos_sin(config, params, shape.family.neox, 4096, torch.float32)
            assert ours_dim == ref_dim == int(shape.head_dim * params.get(
                "partial_rotary_factor", 1.0))
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
